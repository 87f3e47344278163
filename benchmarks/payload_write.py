"""A fetch's payload write for all-token captures: rows of several chunks written part by
part (`delivery.hostmem.Chunked`) against concatenated first, and the frontend's read of it.

    python benchmarks/payload_write.py [--requests 32] [--reps 8]

Each request holds a 128-token prompt block and two decode runs of 64 steps (strided views of
their runs' buffers, as `delivery/runs.py` hands them over) at 4 points of a 1536-wide model
(3 MiB in bf16); the payload goes into a handed-back file in /dev/shm (an engine's steady
state). Variants: concatenated first, part by part with torch's threads splitting each part
(the worker before `hostmem.one_thread`), part by part within `one_thread` (the worker now:
the parts over the plugin's copy threads). Prints µs per request, each variant's reps sorted:
the worker's write, the frontend's read of the file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vllm_hook.delivery import spill  # noqa: E402
from vllm_hook.delivery.hostmem import as_tensor, one_thread  # noqa: E402
from vllm_hook.delivery.store import RequestStore, batch_to_wire  # noqa: E402

H, G, P, STEPS = 1536, 4, 128, 64


def store() -> RequestStore:
    s = RequestStore()
    s.add(tuple(range(G)), np.arange(P), torch.randn(G * P, H).bfloat16(), False)
    for r in range(2):
        run = torch.randn(STEPS, 12 * G, H).bfloat16()           # [steps, rows of 12 requests, width]
        s.add(tuple(range(G)), np.arange(P + r * STEPS, P + (r + 1) * STEPS),
              run[:, 8:8 + G].transpose(0, 1), False, blocked=True)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    directory = tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    target = spill.spill_target(directory)
    stores = [store() for _ in range(args.requests)]
    spill.open_entry(batch_to_wire([({"req_id": "0"}, stores[0]._tensors())], target))   # a file to reuse
    modes = ("concatenated first", "part by part, torch's threads", "part by part, one_thread")
    res: dict[str, list[float]] = {m: [] for m in modes}
    read: dict[str, list[float]] = {m: [] for m in modes}
    print(f"torch threads {torch.get_num_threads()}, cpus {len(os.sched_getaffinity(0))}", flush=True)
    for _ in range(args.reps):
        for mode in modes:
            with one_thread() if mode.endswith("one_thread") else contextlib.nullcontext():
                t = time.perf_counter()
                parts = []
                for j, s in enumerate(stores):
                    ts = s._tensors()
                    if mode == "concatenated first":
                        ts = {k: as_tensor(v) for k, v in ts.items()}
                    parts.append(({"req_id": str(j)}, ts))
                wire = batch_to_wire(parts, target)
                res[mode].append(1e6 * (time.perf_counter() - t) / len(stores))
            t = time.perf_counter()
            spill.open_entry(wire)          # read and handed back: the next write reuses it
            read[mode].append(1e6 * (time.perf_counter() - t) / len(stores))
    for mode in modes:
        print(f"{mode:32s} µs per request: write {[round(x) for x in sorted(res[mode])]}, "
              f"read {[round(x) for x in sorted(read[mode])]}")


if __name__ == "__main__":
    main()
