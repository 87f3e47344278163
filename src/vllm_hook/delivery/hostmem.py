"""Host memory for large result tensors.

Copying a capture into freshly allocated memory costs a page fault per 4 KiB page, which is
several times the copy itself (`benchmarks/host_memory.py`). Large tensors are therefore
placed in an anonymous mapping advised to use transparent huge pages (2 MiB: 512x fewer
faults) where the kernel allows it (`transparent_hugepage` = always or madvise); elsewhere
the advice is ignored and this is an ordinary allocation. Where free memory is fragmented,
the kernel may compact it to find a huge page, and that first touch stalls instead
(`host_memory.py` reports the median next to the best time for that reason).
"""

from __future__ import annotations

import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import torch

HUGE = 2 << 20
MIN_BYTES = 2 * HUGE   # smaller tensors gain little, and would waste up to half a huge page


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised, writable CPU tensor; huge-page backed from 4 MiB up. The memory lives
    as long as a tensor viewing it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass
    raw = torch.frombuffer(m, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE                 # huge pages need 2 MiB-aligned ranges
    return raw[start:start + nbytes].view(dtype).view(shape)


# vLLM runs torch on one CPU thread while serving in most set-ups (spinning OpenMP threads
# would contend with the engine), and file reads and writes run on one core anyway: large
# copies are split over a few threads of the plugin's own instead (torch and the file calls
# release the GIL while they copy).
COPY_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) // 2))
CHUNK_BYTES = 1 << 20
_pool: ThreadPoolExecutor | None = None


def copy_many(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for every (dst, src) pair (dtype conversion included), in parallel when
    the total is large. Pieces are row ranges of about CHUNK_BYTES."""
    total = sum(d.numel() * d.element_size() for d, _ in pairs)
    if COPY_THREADS == 1 or total < 4 * CHUNK_BYTES:
        for d, s in pairs:
            d.copy_(s)
        return
    pieces = []
    for d, s in pairs:
        if d.dim() == 0 or d.numel() == 0:
            d.copy_(s)
            continue
        row = max(1, d[0].numel() * d.element_size())
        step = max(1, CHUNK_BYTES // row)
        pieces += [(d[i:i + step], s[i:i + step]) for i in range(0, d.shape[0], step)]
    # Inference mode is per thread, and vLLM's worker creates its tensors in it: the copies
    # must run in the caller's mode (an inference tensor refuses in-place writes outside it).
    mode = torch.is_inference_mode_enabled()
    _in_threads([(_copy, d, s, mode) for d, s in pieces])


def read_into(fd: int, dst: torch.Tensor, offset: int = 0) -> None:
    """Fill the contiguous uint8 tensor `dst` from file `fd` at `offset`: the kernel copies
    straight into `dst` (no mapping to set up and tear down), in pieces read in parallel."""
    view = memoryview(dst.numpy()).cast("B")
    _in_threads([(_pread, fd, view[a:b], offset + a) for a, b in _pieces(len(view))])


def write_from(fd: int, parts: list[tuple[torch.Tensor, int]]) -> None:
    """Write each contiguous uint8 tensor of `parts` to file `fd` at its offset, in parallel
    pieces."""
    jobs = []
    for src, offset in parts:
        view = memoryview(src.numpy()).cast("B")
        jobs += [(_pwrite, fd, view[a:b], offset + a) for a, b in _pieces(len(view))]
    _in_threads(jobs)


def _pieces(n: int) -> list[tuple[int, int]]:
    step = max(CHUNK_BYTES, -(-n // (4 * COPY_THREADS)))
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _in_threads(jobs: list[tuple]) -> None:
    global _pool
    if COPY_THREADS == 1 or len(jobs) < 2:
        for fn, *args in jobs:
            fn(*args)
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="vllm_hook_copy")
    for f in [_pool.submit(*job) for job in jobs]:
        f.result()


def _copy(dst: torch.Tensor, src: torch.Tensor, inference: bool) -> None:
    with torch.inference_mode(inference):
        dst.copy_(src)


def _pread(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset}")
        view, offset = view[n:], offset + n


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
