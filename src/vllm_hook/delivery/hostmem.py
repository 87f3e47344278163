"""Host memory for large result tensors.

Copying a capture into freshly allocated memory costs a page fault per 4 KiB page, which is
several times the copy itself (`benchmarks/host_memory.py`). Tensors from 1 MiB are therefore
placed in anonymous mappings that are reused (`Recycler`), from 4 MiB advised to use
transparent huge pages (2 MiB: 512x fewer faults) where the kernel allows it
(`transparent_hugepage` = always or madvise); elsewhere
the advice is ignored and this is an ordinary allocation. Where free memory is fragmented,
the kernel may compact it to find a huge page, and that first touch stalls instead
(`host_memory.py` reports the median next to the best time for that reason). Even huge pages
are zeroed by the kernel when first touched: a mapping no tensor views any more is reused
(`Recycler`).

Also here: the scope of the plugin's host work (`one_thread`), and the copies between such
memory, files and the device (`copy_many`, `read_into`, `write_mapped`, `upload`).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

HUGE = 2 << 20
MIN_BYTES = 2 * HUGE   # huge pages from here: smaller tensors would waste up to half of one
RECYCLE_FROM = 1 << 20  # mappings (reused, `Recycler`) from here; below, malloc's memory
GRAIN = 256 << 10       # below MIN_BYTES, mapping sizes in these steps: like sizes reuse alike


# Idle mappings a process keeps for reuse, at most: a batch's float32 rows of a mixed batch of
# 256 requests (85 all-token requests of 6 MiB) and its payload.
KEEP_IDLE_BYTES = 1 << 30


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised, writable CPU tensor; from 1 MiB in a mapping reused once no tensor
    views it (`Recycler`), huge-page backed from 4 MiB. The memory lives as long as a tensor
    viewing it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < RECYCLE_FROM or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    size, huge = _mapping_size(nbytes)
    m = RECYCLER.take(size, huge)
    if m is None:
        m = _new_mapping(size, huge)
    start = _start(m, huge)
    # A storage of the tensor's bytes alone: one of the whole mapping would carry its slack,
    # and a reused mapping's earlier contents, into a pickle or `torch.save` of the tensor
    raw = torch.frombuffer(m, dtype=torch.uint8, offset=start, count=nbytes)
    RECYCLER.lend(m, raw)
    return raw.view(dtype).view(shape)


def _start(m: mmap.mmap, huge: bool) -> int:
    """Where a tensor starts in mapping `m`: huge pages need 2 MiB-aligned ranges."""
    if not huge:
        return 0
    view = (ctypes.c_char * 1).from_buffer(m)
    try:
        return -ctypes.addressof(view) % HUGE
    finally:
        del view                     # (an exported buffer would keep `m` from closing)


def _mapping_size(nbytes: int) -> tuple[int, bool]:
    """(bytes to map, huge pages?) for a tensor of `nbytes`; a huge one has room to align."""
    if nbytes >= MIN_BYTES:
        return -(-(nbytes + HUGE) // HUGE) * HUGE, True
    return -(-nbytes // GRAIN) * GRAIN, False


def _new_mapping(size: int, huge: bool) -> mmap.mmap:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return m


class Recycler:
    """`host_empty`'s mappings, taken back once no tensor views them (the user dropped the
    Results; a payload was parsed): a later tensor of a like size reuses their pages instead
    of faulting in fresh ones, each of which the kernel zeroes first (6 MiB of float32 rows
    took 722 µs into fresh memory, 90 into reused, on the H200 host: run 67). Idle mappings
    up to `keep` bytes; beyond it, those idle longest are unmapped.

    A user who keeps a batch's outputs while the next batch runs (`outs = llm.generate(...)`
    in a loop) frees them only after the next batch's results are built, so those would
    always get fresh pages: `refill_soon` (called after a delivery) maps and touches, on a
    background thread while the next batch runs, as many mappings as were taken since its
    last call, so the next delivery finds its memory ready. That costs up to one batch's
    results of memory more, within `keep`."""

    def __init__(self, keep: int = KEEP_IDLE_BYTES):
        self.keep = keep
        self.lent: deque[tuple[mmap.mmap, StorageWeakRef]] = deque()
        self.idle: dict[int, list[tuple[int, mmap.mmap]]] = {}     # by size: (when idled, mapping)
        self.idle_bytes = 0
        self._tick = 0
        self.taken: dict[tuple[int, bool], int] = {}   # (size, huge) -> count since refill_soon
        self.refills = 0                               # mappings readied in the background
        self._scan_at = 64
        self._lock = threading.Lock()
        self._filling = False

    def take(self, size: int, huge: bool = True) -> mmap.mmap | None:
        """An idle mapping of `size` bytes to twice that, the smallest, or None."""
        with self._lock:
            if len(self.taken) < 1024 or (size, huge) in self.taken:
                self.taken[(size, huge)] = self.taken.get((size, huge), 0) + 1
            self._reap()
            fits = [n for n in self.idle if size <= n <= 2 * size]
            if not fits:
                return None
            n = min(fits)
            _, m = self.idle[n].pop()
            if not self.idle[n]:
                del self.idle[n]
            self.idle_bytes -= n
            return m

    def lend(self, m: mmap.mmap, raw: torch.Tensor) -> None:
        with self._lock:
            self.lent.append((m, StorageWeakRef(raw.untyped_storage())))

    def refill_soon(self) -> None:
        """Ready idle mappings for what was taken since the last call, in the background."""
        with self._lock:
            if self._filling or not self.taken:
                return
            want, self.taken = self.taken, {}
            self._filling = True
        _filler().submit(self._fill, want)

    def _fill(self, want: dict[tuple[int, bool], int]) -> None:
        try:
            for (size, huge), count in want.items():
                with self._lock:
                    self._reap()
                    count -= len(self.idle.get(size, ()))
                for _ in range(count):
                    with self._lock:
                        if self.idle_bytes + size > self.keep:
                            return
                    m = _new_mapping(size, huge)
                    # Fault in the pages a tensor will use (torch releases the GIL meanwhile).
                    torch.frombuffer(m, dtype=torch.uint8, offset=_start(m, huge),
                                     count=size - (HUGE if huge else 0)).zero_()
                    with self._lock:
                        self._add_idle(size, m)
                        self.refills += 1
        finally:
            self._filling = False

    def _reap(self) -> None:
        """Take back the lent mappings no tensor views any more: the oldest first, stopping at
        one still viewed; all of them once the queue doubled since the last full pass (a kept
        old result must not hold back those freed after it)."""
        if len(self.lent) >= self._scan_at:
            alive: deque = deque()
            for m, ref in self.lent:
                if ref.expired():
                    self._idle(m)
                else:
                    alive.append((m, ref))
            self.lent = alive
            self._scan_at = max(64, 2 * len(alive))
            return
        while self.lent and self.lent[0][1].expired():
            self._idle(self.lent.popleft()[0])

    def _idle(self, m: mmap.mmap) -> None:
        """Keep `m` idle, making room by unmapping the mappings idle longest: the sizes of a
        workload no longer run would otherwise hold the room for good (run 153: after batches
        of float32 results, the same batch's bf16 results faulted in fresh pages every time,
        254 faults a request)."""
        n = len(m)
        if n > self.keep:
            _close(m)
            return
        while self.idle_bytes + n > self.keep:
            size = min(self.idle, key=lambda k: self.idle[k][0][0])
            _, old = self.idle[size].pop(0)
            if not self.idle[size]:
                del self.idle[size]
            self.idle_bytes -= size
            _close(old)
        self._add_idle(n, m)

    def _add_idle(self, n: int, m: mmap.mmap) -> None:
        self.idle.setdefault(n, []).append((self._tick, m))      # each size's list oldest first
        self._tick += 1
        self.idle_bytes += n


def _close(m: mmap.mmap) -> None:
    """Unmap `m`, which no tensor views (`_reap`): torch holds no buffer export, so closing a
    mapping a tensor still viewed would unmap its memory under it."""
    try:
        m.close()
    except BufferError:        # an export still held (not torch's): unmapped with its holder
        pass


_filler_pool: ThreadPoolExecutor | None = None


def _filler() -> ThreadPoolExecutor:
    global _filler_pool
    if _filler_pool is None:
        _filler_pool = ThreadPoolExecutor(1, thread_name_prefix="vllm_hook_prefault")
    return _filler_pool


RECYCLER = Recycler()
MADV_POPULATE_READ = 22              # Linux 5.14 on


def populate_soon(buf: mmap.mmap) -> None:
    """Map the pages of the shared mapping `buf` (whose pages all exist) into this process's
    page tables on the background thread, a range at a time (the kernel's work, without the
    GIL), so that reading it later takes no page fault. Older kernels: left to fault."""
    _filler().submit(_populate, buf)


def _populate(buf: mmap.mmap) -> None:
    try:
        arr = np.frombuffer(buf, dtype=np.uint8)
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        step = 64 << 20
        for a in range(0, arr.nbytes, step):
            if madvise(arr.ctypes.data + a, min(step, arr.nbytes - a), MADV_POPULATE_READ) != 0:
                return
    except (OSError, ValueError, AttributeError):
        return


class Lazy:
    """What a tensor not yet made of its parts answers like one: its shape's size, its
    element size, its dimensions (`shape` and `dtype` set by the subclass)."""

    __slots__ = ()
    shape: torch.Size
    dtype: torch.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)


class Chunked(Lazy):
    """A tensor [points, rows, ...] kept as the parts it arrived in along dim 1 (a request's
    decode runs, each a strided view of its run's buffer): a payload write copies each part
    once, straight to its place, instead of through a concatenated copy first. `tensor()`
    concatenates it where a real tensor is needed."""

    __slots__ = ("parts", "shape", "dtype", "_joined")

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts
        self.shape = torch.Size((parts[0].shape[0], sum(p.shape[1] for p in parts), *parts[0].shape[2:]))
        self.dtype = parts[0].dtype
        self._joined: torch.Tensor | None = None

    def pairs(self, dst: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, part) copies that fill `dst` (of this shape and dtype)."""
        out, at = [], 0
        for p in self.parts:
            out.append((dst[:, at:at + p.shape[1]], p))
            at += p.shape[1]
        return out

    def tensor(self) -> torch.Tensor:
        # `copy_many`, as the parse's join: large copies over threads, also within
        # `one_thread` (the frontend's build), where `torch.cat` ran on one
        out = host_empty(tuple(self.shape), self.dtype)
        copy_many(self.pairs(out), parallel_from=CHUNK_BYTES)
        return out

    def row(self, g: int) -> "Rows":
        """Point `g`'s rows, not joined."""
        return Rows(self, g, self.shape[1])

    def joined(self) -> torch.Tensor:
        """`tensor()`, made once: every `Rows` of it that needs a real tensor views this one
        block (a site's layers back to back, as a parse's join lays them out)."""
        if self._joined is None:
            self._joined = self.tensor()
        return self._joined


class Rows(Lazy):
    """The first `stop` rows of point `g` of a `Chunked` [points, rows, ...]: a served result's
    every-token rows (a prompt block and decode runs the worker lent) left as those parts,
    which `StParts` writes to the result's file piece by piece, where joining them first was a
    copy on the API server's event loop (`parse_batch(join=False)`). `tensor()` joins the
    whole `Chunked` once where a real tensor is needed."""

    __slots__ = ("of", "g", "stop", "shape", "dtype")

    def __init__(self, of: Chunked, g: int, stop: int):
        self.of, self.g, self.stop = of, g, stop
        self.shape = torch.Size((stop, *of.shape[2:]))
        self.dtype = of.dtype

    def __getitem__(self, key: Any) -> "Rows | torch.Tensor":
        if isinstance(key, slice) and key.start in (None, 0) and key.step in (None, 1):
            stop = self.stop if key.stop is None else key.stop
            return Rows(self.of, self.g, max(0, min(stop if stop >= 0 else self.stop + stop, self.stop)))
        return self.tensor()[key]

    def pieces(self) -> list[torch.Tensor]:
        """Its rows as views of the parts, in order (each part's rows may be strided)."""
        out, left = [], self.stop
        for p in self.of.parts:
            if left <= 0:
                break
            take = min(left, p.shape[1])
            out.append(p[self.g, :take])
            left -= take
        return out

    def tensor(self) -> torch.Tensor:
        return self.of.joined()[self.g, :self.stop]


def as_tensor(t: "torch.Tensor | Chunked | Any") -> torch.Tensor:
    """A real tensor of `t` (a `Chunked`, or another such part list with `tensor()`)."""
    return t if isinstance(t, torch.Tensor) else t.tensor()


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device` without waiting for the device: through pinned memory,
    whose block torch's caching host allocator keeps until the copy is done (a copy from
    ordinary memory waits for every step already queued on the stream)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


# The plugin's host work runs with torch on one thread (`one_thread`); its large copies get
# torch's threads back where it has several. Where torch runs on one (vLLM's multiprocess
# workers), large copies and file reads are split over a few threads of the plugin's own
# (torch and the file calls release the GIL while they copy).
COPY_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) // 2))
CHUNK_BYTES = 1 << 20
_pool: ThreadPoolExecutor | None = None


def _torch_parallel() -> bool:
    return torch.get_num_threads() > 1


_scope = threading.local()


@contextmanager
def one_thread():
    """Torch runs this thread's host ops on one thread within: the plugin's host work is many
    small tensors, and each op over torch's grain splits over every core, whose sleeping
    threads take about a millisecond to wake on the H200 host (run 65: the capture's
    frontend read 138 -> 36 µs a request at 64 requests). `copy_many` gives large copies
    torch's threads back."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    _scope.outer = n
    try:
        yield
    finally:
        _scope.outer = None
        torch.set_num_threads(n)


def coalesce(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Merge runs of pairs whose sources and destinations both follow one another in memory
    (contiguous, same storage and dtype) into one flat pair each: one large copy instead of
    many (each torch copy is its own parallel region, and one slow thread holds up each)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for d, s in pairs:
        if out and d.numel() and _follows(out[-1][0], d) and _follows(out[-1][1], s):
            pd, ps = out[-1]
            out[-1] = (_flat(pd, pd.numel() + d.numel()), _flat(ps, ps.numel() + s.numel()))
        else:
            out.append((d, s))
    return out


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous() and a.numel() > 0
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() + a.numel() == b.storage_offset())


def _flat(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (n,), (1,))


def copy_many(pairs: list[tuple[torch.Tensor, torch.Tensor]], parallel_from: int = 4 * CHUNK_BYTES) -> None:
    """dst.copy_(src) for every (dst, src) pair (dtype conversion included), in parallel when
    the total is `parallel_from` bytes or more. Pieces are row ranges of about CHUNK_BYTES."""
    pairs = coalesce(pairs)
    total = sum(d.numel() * d.element_size() for d, _ in pairs)
    outer = getattr(_scope, "outer", None)
    if outer and total >= parallel_from:
        # Within one_thread(), large copies: torch's threads again, one parallel region per
        # copy (back to back, they find its threads awake: a request's float32 rows took 222 µs
        # so at 64 requests on the H200 host, 746 on one thread, run 66; 64 parts of 0.75 MiB
        # 1.4 to 2.2 ms so, 4.2 to 5.2 over the plugin's 8 copy threads, run 67).
        torch.set_num_threads(outer)
        try:
            for d, s in pairs:
                d.copy_(s)
        finally:
            torch.set_num_threads(1)
        return
    if COPY_THREADS == 1 or total < parallel_from or _torch_parallel():
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


def write_mapped(fd: int, size: int, parts: list[tuple[torch.Tensor, int]],
                 chunked: list[tuple[Chunked, int]] = ()) -> None:
    """Write each contiguous uint8 tensor of `parts` (and each `Chunked` of `chunked`, part by
    part) at its offset into file `fd`, whose first `size` bytes must exist (allocated, not
    sparse), through a shared mapping: tmpfs serialises write() calls to one file on its inode
    lock, while copies into a mapping run in parallel, and MAP_POPULATE maps every page in one
    call instead of a fault per page."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        dst = torch.frombuffer(m, dtype=torch.uint8)
        pairs = [(dst[o:o + src.numel()], src) for src, o in parts if src.numel()]
        for c, o in chunked:
            n = c.numel() * c.element_size()
            pairs += c.pairs(dst[o:o + n].view(c.dtype).view(c.shape))
        copy_many(pairs)
        del dst, pairs
    finally:
        try:
            m.close()
        except BufferError:     # a view outlived the copy (in a traceback): unmapped when freed
            pass


def write_new(fd: int, parts: list[tuple[torch.Tensor, int]]) -> None:
    """Write each contiguous uint8 tensor of `parts` at its offset into file `fd`, with write
    calls. For pages the file does not hold yet: a mapping would have to map each fresh page
    (MAP_POPULATE), which costs more than the kernel's copy into them (0.4 against 0.8 s per
    GiB on the CI machine's tmpfs). Parts that lie back to back go in one gathering call
    (`write_views`)."""
    run: list[memoryview] = []
    start = end = 0
    for src, offset in sorted(parts, key=lambda p: p[1]):
        view = memoryview(src.numpy()).cast("B")
        if run and offset != end:
            write_views(fd, run, start)
            run = []
        if not run:
            start = end = offset
        run.append(view)
        end += len(view)
    if run:
        write_views(fd, run, start)


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of `t` as numpy sees them: its elements as integers of their width, strides
    kept (numpy has no bfloat16; its copies run on the calling thread alone, where a torch
    copy on a thread of the plugin's own wakes a team of torch's threads of its own)."""
    return t.view(_RAW[t.element_size()]).numpy()


def byte_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    """The bytes of `tensors` in order, as views: of a tensor's own memory where it is
    contiguous; else (a decode run's rows of one request, lent by the worker: rows apart) of
    a copy in a buffer of this thread's own, reused (numpy's copy, on this thread alone: a
    torch copy on a thread of the plugin's own wakes a team of torch's threads of its own),
    valid until this thread's next call. Gathering the rows where they lie instead
    (`pwritev` a row each) cost the kernel more: 3.1 MB results 0.72 against 0.55 to 0.60 ms each
    on the CI machine."""
    need = sum(t.numel() * t.element_size() for t in tensors if not t.is_contiguous())
    buf = getattr(_SCRATCH, "buf", None)
    if need and (buf is None or len(buf) < need):
        buf = np.empty(max(need, CHUNK_BYTES), dtype=np.uint8)
        if need <= SCRATCH_KEEP:           # kept for this thread's next result; larger ones not
            _SCRATCH.buf = buf
    out, at = [], 0
    for t in tensors:
        if t.numel() == 0:
            continue
        src = raw(t)
        if t.is_contiguous():
            out.append(memoryview(src.reshape(-1).view(np.uint8)))
            continue
        n = src.nbytes
        np.copyto(buf[at:at + n].view(src.dtype).reshape(src.shape), src)
        out.append(memoryview(buf[at:at + n]))
        at += n
    return out


_SCRATCH = threading.local()
SCRATCH_KEEP = 16 << 20      # bytes of such a buffer a thread keeps (an every-token result's runs)


def write_views(fd: int, views: list[memoryview], offset: int = 0) -> None:
    """Write `views` back to back at `offset` into file `fd` with gathering write calls
    (`pwritev`, up to IOV_MAX pieces each): the kernel copies each piece from where it lies,
    and a result of a few dozen pieces costs one call, where a call a piece cost about 15 µs
    each on the CI machine's tmpfs."""
    views = [v for v in views if len(v)]
    i = 0
    while i < len(views):
        n = os.pwritev(fd, views[i:i + _IOV_MAX], offset)
        if n <= 0:
            raise OSError(f"pwritev wrote nothing at byte {offset}")
        offset += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:                              # a short write: the rest of that piece next
            views[i] = views[i][n:]


_IOV_MAX = max(1, min(1024, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024))


def map_file(fd: int, size: int) -> torch.Tensor:
    """The first `size` bytes of file `fd` (open for reading and writing) as a writable uint8
    tensor, without copying them, its pages mapped in one call (MAP_POPULATE). A shared
    mapping: a private one would copy every page as MAP_POPULATE maps it for writing; writes
    reach the file, so it must be this process's alone (deleted). The mapping lives as long
    as a tensor viewing it."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(m, dtype=torch.uint8)


def _pieces(n: int) -> list[tuple[int, int]]:
    step = max(CHUNK_BYTES, -(-n // (4 * COPY_THREADS)))
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _in_threads(jobs: list[tuple]) -> None:
    """Run `jobs` ((fn, *args) each) over the copy threads, one batch of them per thread."""
    global _pool
    k = min(COPY_THREADS, len(jobs))
    if k < 2:
        for job in jobs:
            _run((job,))
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="vllm_hook_copy")
    for f in [_pool.submit(_run, jobs[i::k]) for i in range(k)]:
        f.result()


def _run(jobs) -> None:
    for fn, *args in jobs:
        fn(*args)


def _copy(dst: torch.Tensor, src: torch.Tensor, inference: bool) -> None:
    with torch.inference_mode(inference):
        dst.copy_(src)


def _pread(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset}")
        view, offset = view[n:], offset + n
