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
