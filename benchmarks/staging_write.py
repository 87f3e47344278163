"""Host time to route a prefill step steered at every token: rows written vs one row copied on the device.

    python3 benchmarks/staging_write.py [--out DIR]          # on the GPU host (no vLLM needed)

A 28-layer all-layer steering spec fills 56 int64 op columns (448 bytes) per prompt row. The
worker's staging arrays are pinned host memory; the step's rows are uploaded from there. Per
step size: writing every row into pinned memory, the same into ordinary memory, and
`routing.broadcast_rows`'s way (one row written, uploaded, copied over the rest on the device),
each with the upload queued, median of 50 (µs of host time). Needs torch only (runs before the
kit is unpacked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

WIDTH = 56


def _time(f, reps: int = 50) -> float:
    for _ in range(5):
        f()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    row = np.arange(1, WIDTH + 1, dtype=np.int64)
    rows = {}
    for T in (8192, 16384, 32768):
        op_dev = torch.zeros(T, WIDTH, dtype=torch.int64, device=dev)
        pinned = torch.zeros(T, WIDTH, dtype=torch.int64).pin_memory()
        plain = torch.zeros(T, WIDTH, dtype=torch.int64)
        pn, pl = pinned.numpy(), plain.numpy()

        def write_pinned():
            pn[:] = row
            op_dev.copy_(pinned, non_blocking=True)

        def write_plain():
            pl[:] = row

        def broadcast():
            pn[0] = row
            op_dev.copy_(pinned, non_blocking=True)
            op_dev[1:].copy_(op_dev[:1].expand(T - 1, -1))     # as routing.broadcast_rows

        rows[T] = {"pinned rows written + upload": _time(write_pinned),
                   "ordinary memory, rows written": _time(write_plain),
                   "one row + device copy (+ upload)": _time(broadcast)}
        assert (op_dev.cpu().numpy() == row).all()
    text = json.dumps(rows, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "staging_write.json").write_text(text)


if __name__ == "__main__":
    main()
