"""The process's collector clock reported beside the plugin's counters (`gc_s`)."""

from __future__ import annotations

import gc

from vllm_hook.gc_clock import process_clock


def test_process_clock_counts_collections_and_full_ones():
    clock = process_clock()
    assert process_clock() is clock                    # one per process
    before = clock.counters()
    gc.collect(0)
    gc.collect()
    after = clock.counters()
    assert after["gc_collections"] - before["gc_collections"] >= 2
    assert after["gc_full_collections"] - before["gc_full_collections"] >= 1
    assert after["gc_s"] > before["gc_s"]


def test_a_forked_child_counts_from_zero():
    import os

    clock = process_clock()
    gc.collect()
    assert clock.total > 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: report its clock, then leave
        os.write(w, repr((clock.total, clock.collections)).encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 100)
    os.waitpid(pid, 0)
    assert got == b"(0.0, 0)"
