"""What moving one large capture costs in host memory on this machine (no engine, no GPU).

A 512-token all-layer capture of the Qwen2-1.5B shape is 42 MiB in bf16. Each stage of its
delivery is a copy, and a copy into freshly allocated memory also pays a page fault per 4 KiB
page, often several times the copy itself. This times the copies the delivery path can make:
into fresh memory, into memory faulted in before, into anonymous memory advised to use huge
pages, and into a new file in /dev/shm; and a 1 GiB result's spill round trip (the worker's
write, the frontend's open) through a fresh file and through a reused one.

    python benchmarks/host_memory.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time
import uuid

import torch

from vllm_hook.delivery import hostmem
from vllm_hook.delivery.hostmem import copy_many, host_empty, read_into, write_mapped

ROWS, HIDDEN = 29 * 512, 1536


def _best(fn, reps: int) -> str:
    """Best and median ms of `reps` calls (a huge-page fault can stall on compaction)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return f"{1e3 * min(times):.1f} (median {1e3 * statistics.median(times):.1f})"


def _plain_anon(nbytes: int, dtype, shape):
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=dtype).view(shape)


def _shm_write(src: torch.Tensor, directory: str) -> None:
    path = os.path.join(directory, f"vllm_hook-bench-{uuid.uuid4().hex}")
    with open(path, "wb") as f:
        f.write(src.view(torch.int16).numpy().data)
    os.unlink(path)


def _reused_file(src: torch.Tensor, directory: str, reps: int) -> dict[str, str]:
    """Writes into and reads from a file whose pages exist (a spill file handed back)."""
    path = os.path.join(directory, f"vllm_hook-bench-{uuid.uuid4().hex}")
    flat = src.view(-1).view(torch.uint8)
    n = flat.numel()
    view = memoryview(flat.numpy())
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, n)
        step = -(-n // hostmem.COPY_THREADS)
        jobs = [(os.pwrite, fd, view[a:a + step], a) for a in range(0, n, step)]
        return {
            "bf16 write to a reused file, one write()": _best(lambda: os.pwrite(fd, view, 0), reps),
            f"bf16 write to a reused file, {len(jobs)} threads of write()": _best(
                lambda: hostmem._in_threads(jobs), reps),
            "bf16 write to a reused file, write_mapped": _best(lambda: write_mapped(fd, n, [(flat, 0)]), reps),
            "bf16 read from the file, read_into host_empty": _best(
                lambda: read_into(fd, host_empty((n,), torch.uint8)), reps),
        }
    finally:
        os.close(fd)
        os.unlink(path)


def _spill_round_trips(directory: str, mib: int, reps: int) -> dict[str, str]:
    """A worker's write of a `mib` MiB result and the frontend's open of it (delivery/spill.py):
    into fresh pages and mapped (a file too large to keep), and through a handed-back file."""
    from vllm_hook.delivery import spill

    src = host_empty((mib << 19,), torch.bfloat16).fill_(1.5)
    target = spill.spill_target(directory)
    keep = spill.KEEP_FREE_BYTES
    out = {}
    try:
        for label, limit in (("fresh file, mapped", 0), ("reused file, read", 1 << 40)):
            spill.KEEP_FREE_BYTES = limit
            write = lambda: spill.write_spilled({"x": src}, {}, target["dir"])  # noqa: E731
            spill.open_entry({"path": write()})           # a first file to reuse
            paths = []
            out[f"{mib} MiB spill write, {label}"] = _best(lambda: paths.append(write()), reps)
            out[f"{mib} MiB spill open, {label}"] = _best(lambda: spill.open_entry({"path": paths.pop()}), reps)
    finally:
        spill.KEEP_FREE_BYTES = keep
        for name in os.listdir(directory):
            if name.startswith(spill.FREE):
                os.unlink(os.path.join(directory, name))
    return out


def measure(reps: int = 7, shm: str = "/dev/shm", spill_mib: int = 1024) -> dict[str, float]:
    src = torch.randn(ROWS, HIDDEN).to(torch.bfloat16)
    warm16, warm32 = torch.empty_like(src), torch.empty(src.shape)
    out = {
        "threads": torch.get_num_threads(),
        "bf16 clone, fresh memory": _best(lambda: src.clone(), reps),
        "bf16 copy, memory faulted in": _best(lambda: warm16.copy_(src), reps),
        "bf16 copy, fresh anonymous mmap": _best(
            lambda: _plain_anon(src.numel() * 2, src.dtype, src.shape).copy_(src), reps),
        "bf16 copy, host_empty (huge pages)": _best(
            lambda: host_empty(src.shape, src.dtype).copy_(src), reps),
        "to float32, fresh memory": _best(lambda: src.float(), reps),
        "to float32, memory faulted in": _best(lambda: warm32.copy_(src), reps),
        "to float32, host_empty (huge pages)": _best(
            lambda: host_empty(src.shape, torch.float32).copy_(src), reps),
    }
    torch_parallel = hostmem._torch_parallel
    try:
        hostmem._torch_parallel = lambda: False
        out["to float32, host_empty, copy threads"] = _best(
            lambda: copy_many([(host_empty(src.shape, torch.float32), src)]), reps)
    finally:
        hostmem._torch_parallel = torch_parallel
    if os.access(shm, os.W_OK):
        out[f"bf16 write to a new file in {shm}"] = _best(lambda: _shm_write(src, shm), reps)
        out.update(_reused_file(src, shm, reps))
        if spill_mib:
            out.update(_spill_round_trips(shm, spill_mib, reps))
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            out["transparent_hugepage"] = f.read().strip()
    except OSError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--spill-mib", type=int, default=1024, help="size of the spill round trips (0: none)")
    ap.add_argument("--out")
    args = ap.parse_args()
    res = measure(args.reps, spill_mib=args.spill_mib)
    for k, v in res.items():
        print(f"{k:40s} {v} ms" if k != "threads" and "hugepage" not in k else f"{k:40s} {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
