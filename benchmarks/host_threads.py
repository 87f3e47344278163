"""What torch's host threads cost the plugin's small tensor ops, on this machine (issue 17).

    python benchmarks/host_threads.py

No engine, no GPU needed. The plugin's delivery converts and copies rows between steps, when
torch's threads have gone to sleep: this times one op woken cold (after a pause) and hot
(back to back), with torch's threads and with one, for tensors from 0.75 MiB to 6 MiB of
float32 output, into fresh and into reused memory; the cost of switching torch's thread
count (what `hostmem.one_thread` does twice a scope); copies of many parts over the
plugin's own copy threads; `host_empty` with its mappings reused and fresh. Prints
microseconds, the median of --reps.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

# hostmem alone (stdlib and torch): this runs on a machine without vLLM too
_spec = importlib.util.spec_from_file_location(
    "hostmem", Path(__file__).resolve().parents[1] / "src/vllm_hook/delivery/hostmem.py")
hostmem = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostmem)


def timed(fn, reps: int, pause: float) -> float:
    out = []
    for _ in range(reps):
        if pause:
            time.sleep(pause)
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1e6 * statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    n = torch.get_num_threads()
    tasks = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    print(f"torch threads {n}, cpus {len(os.sched_getaffinity(0))}, copy threads {hostmem.COPY_THREADS}, "
          f"process threads {tasks()}")
    if n > 1:
        def toggle():
            torch.set_num_threads(1)
            torch.set_num_threads(n)
        print(f"set_num_threads(1) and back: {timed(toggle, 200, 0):.1f} µs; process threads after {tasks()}")
    for rows in (128, 512, 1024):                      # x 1536 bf16 -> float32: 0.75, 3, 6 MiB
        src = torch.randn(rows, 1536).bfloat16()
        dst = torch.empty(rows, 1536)
        mib = rows * 1536 * 4 / (1 << 20)
        line = []
        for threads in sorted({n, 1}, reverse=True):
            torch.set_num_threads(threads)
            for label, pause in (("cold", 0.05), ("hot", 0)):
                reused = timed(lambda: dst.copy_(src), args.reps, pause)
                fresh = timed(lambda: hostmem.host_empty((rows, 1536), torch.float32).copy_(src), args.reps, pause)
                line.append(f"{threads} thr {label}: reused {reused:.0f} / fresh {fresh:.0f}")
        torch.set_num_threads(n)
        print(f"{mib:.2f} MiB float32 from bf16, µs: " + "; ".join(line))
    # Many parts (a payload write's): torch's threads per part, or the plugin's threads once.
    parts = [(torch.empty(4, 64, 1536, dtype=torch.bfloat16), torch.randn(64, 12, 1536).bfloat16()[:, 4:8].transpose(0, 1))
             for _ in range(64)]

    def per_part():
        for d, s in parts:
            d.copy_(s)

    def pool():
        with hostmem.one_thread():
            hostmem.copy_many(parts)
    for label, pause in (("cold", 0.05), ("hot", 0)):
        print(f"64 parts of 0.75 MiB ({label}), µs: torch's threads per part {timed(per_part, args.reps, pause):.0f}, "
              f"copy_many within one_thread {timed(pool, args.reps, pause):.0f}")
    # host_empty's mappings reused (the Recycler) against fresh ones (a Recycler keeping none):
    # a request's float32 rows, 6 MiB, converted within one_thread as the Results build does.
    src = torch.randn(1024, 1536).bfloat16()

    def build():
        with hostmem.one_thread():
            hostmem.copy_many([(hostmem.host_empty((1024, 1536), torch.float32), src)],
                              parallel_from=hostmem.CHUNK_BYTES)
    line = []
    for label, keep in (("reused", hostmem.KEEP_IDLE_BYTES), ("fresh", 0)):
        hostmem.RECYCLER = hostmem.Recycler(keep)
        build()
        line.append(f"{label} {timed(build, args.reps, 0):.0f}")
    print("6 MiB float32 rows into host_empty, µs: " + ", ".join(line))
    batch_conversion(args.reps)


def batch_conversion(reps: int) -> None:
    """A fetch's float32 conversion of the all-token capture third of a mixed batch: R
    requests' rows at 4 layers, a 128-token prompt block (contiguous per request) and a
    128-step decode run (strided: [steps, rows, width]), bf16, into each request's float32
    block [4, 256, 1536] (reused memory): per layer and part on torch's threads (what the
    parse and build do), per part on torch's threads, or the requests spread over the
    plugin's copy threads with torch on one."""
    for R in (21, 85):
        prompt = torch.randn(R * 4 * 128, 1536).bfloat16()
        run = torch.randn(128, R * 4, 1536).bfloat16()
        srcs = [(prompt[r * 512:(r + 1) * 512].view(4, 128, 1536), run[:, r * 4:(r + 1) * 4].transpose(0, 1))
                for r in range(R)]
        dsts = [torch.empty(4, 256, 1536) for _ in range(R)]

        def per_layer():
            with hostmem.one_thread():
                for (p, q), d in zip(srcs, dsts):
                    hostmem.copy_many([(d[g, :128], p[g]) for g in range(4)] + [(d[g, 128:], q[g]) for g in range(4)])

        def per_part():
            with hostmem.one_thread():
                for (p, q), d in zip(srcs, dsts):
                    hostmem.copy_many([(d[:, :128], p), (d[:, 128:], q)])

        def one_request(r):
            d, (p, q) = dsts[r], srcs[r]
            d[:, :128].copy_(p)
            d[:, 128:].copy_(q)

        def over_threads():
            with hostmem.one_thread():
                hostmem._in_threads([(one_request, r) for r in range(R)])
        mb = R * 4 * 256 * 1536 * 4 / 1e6
        line = [f"{name} {timed(fn, reps, 0):.0f}" for name, fn in
                (("per layer, torch's threads", per_layer), ("per part, torch's threads", per_part),
                 ("requests over the plugin's threads", over_threads))]
        print(f"{R} requests' rows to float32 ({mb:.0f} MB), µs: " + ", ".join(line))


if __name__ == "__main__":
    main()
