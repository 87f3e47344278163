"""A worker's shared arena: large captured blocks land here and reach the frontend without a copy.

Without it a large step's rows go device -> pinned block -> a result file the worker writes
-> the frontend's memory: for every layer and token of 32 x 512-token prompts of a 1.5B model
(1.4 GB in bf16) the worker's write alone took 29 ms per request on the H200 host. With it
the device copies a step's rows straight into this arena (anonymous shared memory, page-locked
for the device once, when it is made), and a fetch sends each request's place in it
(`lend`) instead of its bytes; the frontend maps the arena once and its results view it.

Lifetimes. A block (one step's rows of one pool, every request's in that step; or a run of
repeated decode steps, `delivery.runs`, trimmed to its steps when it closes) is held by
the worker while a store views it and by the frontend while results view a piece lent from it;
its range is reused only when both are done. The frontend's side is a flag byte per lent piece
in the arena's header: set by the worker when it lends the piece, cleared by the frontend when
the last view of the piece is freed (`FrontendArenas`), read by the worker when it needs room
(`reclaim`). The frontend views a reply's pieces as soon as the reply arrives, so a reply that
is never parsed (a failed rank, a cancelled fetch) gives them back when it is dropped. Results
a user keeps hold their step's whole block; when the arena is full, steps use the pinned or
copied path as before (nothing is lost, it is only slower). A reply lost between the processes
keeps its pieces out until the worker exits.

Clean marks. The header also holds a word per request slot (`MARKS`) that lets a served or
offline frontend deliver a steering-only request without a fetch RPC: the frontend gives such
a request a ticket (a slot and a tag unique to it); the worker writes the tag into the slot
once it has admitted the request cleanly, and zeroes it at the request's first error. A
finished request whose tag is still in its slot on every rank has nothing to fetch. Anything
else (another request's tag, zero, an arena the frontend has not mapped) means "fetch", as
before: a wrong answer can only cost an RPC, never an error.

Who may map it: the frontend opens `/proc/{pid}/fd/{fd}` of the worker (the file has no
name, so nothing is left behind when a process dies) after checking the host's boot id, and
checks the arena's random token. A worker lends pieces only to a frontend that says it has
mapped this arena (its token in the fetch's arguments); a fetch from one that has not offers
the arena instead (`offer`), so a frontend that cannot map it (another host or pid
namespace) never gets a reference it cannot read.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import stat
import uuid
import weakref

import numpy as np
import torch

from .hostmem import Chunked, populate_soon

log = logging.getLogger("vllm_hook")

ALIGN = 4096
TOKEN_BYTES = 16
SLOTS = 1 << 16                       # pieces lent at once, at most: one flag byte each
MARKS = 1 << 13                       # clean marks: one uint64 per request slot
MARKS_OFFSET = TOKEN_BYTES + SLOTS    # 8-byte aligned
HEADER = -(-(MARKS_OFFSET + 8 * MARKS) // ALIGN) * ALIGN
MIN_BLOCK_BYTES = 64 << 10           # smaller steps are copied (their rows get packed anyway)
HELD, FREE = 1, 0


class Arena:
    """The worker's side: allocates step blocks, lends pieces, reclaims released ones."""

    def __init__(self, nbytes: int, device: torch.device):
        self.size = HEADER + max(0, nbytes) // ALIGN * ALIGN
        self.token = uuid.uuid4().bytes
        self.fd = os.memfd_create("vllm_hook_arena", os.MFD_CLOEXEC)
        try:
            if device.type == "cuda":
                # Its pages now: page-locking needs them all (ENOSPC here, not at a later copy).
                os.posix_fallocate(self.fd, 0, self.size)
            else:
                # On the CPU nothing locks them: pages come as steps first use them (allocating
                # 1.5 GiB up front cost an engine's start 1.4 s on the CI machine).
                os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._map[:TOKEN_BYTES] = self.token
        self.flags = np.frombuffer(self._map, dtype=np.uint8, count=SLOTS, offset=TOKEN_BYTES)
        self.marks = np.frombuffer(self._map, dtype=np.uint64, count=MARKS, offset=MARKS_OFFSET)
        self._ptr = np.frombuffer(self._map, dtype=np.uint8, count=1).__array_interface__["data"][0]
        # On a device every page exists from the start (fallocate): the frontend may map them
        # all in the background (`FrontendArenas.adopt`); on the CPU that would allocate them.
        self.allocated = device.type == "cuda"
        registered = False
        if device.type == "cuda":
            # Page-locked once, so every device copy into it is asynchronous (a copy into
            # pageable memory waits for the stream).
            with torch.cuda.device(device):
                err = torch.cuda.cudart().cudaHostRegister(self._ptr, self.size, 0)
            if int(err) != 0:
                _clear_cuda_error()      # else torch's next launch check would raise it
                os.close(self.fd)
                raise OSError(f"cudaHostRegister of {self.size} bytes failed ({err})")
            registered = True
        # Unregistered and closed when the arena is freed (an in-process engine shut down).
        weakref.finalize(self, _close, self.fd, self._ptr if registered else None)
        self._free: list[tuple[int, int]] = [(HEADER, self.size - HEADER)]   # (offset, size), sorted
        self._blocks: dict[int, list[int]] = {}    # offset -> [size, worker views alive?, pieces lent]
        self._lent: dict[int, list[int]] = {}      # slot -> offsets of the blocks it holds
        self._slots = list(range(SLOTS - 1, -1, -1))
        self._gone: list[int] = []                 # blocks whose worker views died (any thread)
        self.used = 0
        self.pieces_lent = 0                       # counters for stats()
        self.bytes_lent = 0

    # ---- blocks ----------------------------------------------------------------------------
    def alloc(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor in the arena, or None when there is no room even after
        reclaiming released pieces. Its range is free again once no tensor views it and every
        piece lent from it is released."""
        n = int(np.prod(shape)) * dtype.itemsize
        if n == 0 or n > self.size - HEADER:
            return None
        # Released ranges first: reusing them keeps the arena's touched pages (and the RSS of
        # both processes) at the working set, instead of walking the whole arena before reuse.
        self.reclaim()
        off = self._take(n)
        if off is None:
            return None
        size = -(-n // ALIGN) * ALIGN
        self._blocks[off] = [size, 1, 0]
        self.used += size
        arr = np.frombuffer(self._map, dtype=np.uint8, count=n, offset=off)
        weakref.finalize(arr, self._views_gone, off)
        return torch.from_numpy(arr).view(dtype).view(shape)

    def trim(self, t: torch.Tensor, nbytes: int) -> None:
        """Give back the tail of `t`'s block (as `alloc` returned it) past its first `nbytes`:
        nothing views or will write it."""
        off = t.data_ptr() - self._ptr
        block = self._blocks.get(off)
        if block is None:
            return
        keep = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if keep < block[0]:
            self._give_back(off + keep, block[0] - keep)
            self.used -= block[0] - keep
            block[0] = keep

    def _take(self, n: int) -> int | None:
        size = -(-n // ALIGN) * ALIGN
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                return off
        return None

    def _views_gone(self, off: int) -> None:
        # A finalizer: it may run in any thread (a copy thread dropping the last slice), so it
        # only notes the block; the worker's thread frees it (`_collect`).
        self._gone.append(off)

    def _collect(self) -> None:
        while self._gone:
            off = self._gone.pop()
            block = self._blocks.get(off)
            if block is not None:
                block[1] = 0
                self._maybe_free(off, block)

    def _maybe_free(self, off: int, block: list[int]) -> None:
        if block[1] or block[2]:
            return
        del self._blocks[off]
        self.used -= block[0]
        self._give_back(off, block[0])

    def _give_back(self, off: int, size: int) -> None:
        i = bisect.bisect(self._free, (off, size))
        if i < len(self._free) and off + size == self._free[i][0]:      # merge with the next
            size += self._free.pop(i)[1]
        if i and self._free[i - 1][0] + self._free[i - 1][1] == off:     # and the previous
            off, size = self._free[i - 1][0], self._free[i - 1][1] + size
            self._free[i - 1] = (off, size)
        else:
            self._free.insert(i, (off, size))

    # ---- lending ---------------------------------------------------------------------------
    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and self._block_of(t) is not None

    def _block_of(self, t: torch.Tensor) -> int | None:
        return self._block_at(t.data_ptr(), _span(t))

    def _block_at(self, ptr: int, span: int | None) -> int | None:
        """The block holding the bytes [ptr, ptr + span), if one does."""
        start = ptr - self._ptr
        if span is None or start < HEADER or start >= self.size:
            return None
        offs = sorted(self._blocks)     # few blocks (one per large step and pool, one per run)
        i = bisect.bisect(offs, start) - 1
        if i < 0:
            return None
        off = offs[i]
        return off if start + span <= off + self._blocks[off][0] else None

    def lend(self, t: "torch.Tensor | Chunked") -> dict | None:
        """A reference to `t` (in the arena: contiguous, or a strided view such as a request's
        rows of a decode run) the frontend can view: its block stays until the frontend
        releases it. None when it is not in the arena or no flag is free.

        A `Chunked` (a request's prompt block and decode runs) is lent under one flag, viewed
        through one base spanning its parts ({"parts": [[offset in the span, shape, strides]
        or None]}: offline the frontend copies them out at once, so one release for all
        costs nothing, and viewing each part on its own cost 16 µs a part; served, its API
        server writes the result from them: released when their last view goes, the
        response's results and the fetch reply's views, which the requests fetched together
        share); a part not in the
        arena (a decode step routed on its own, in host memory) is None, sent by value."""
        parts = t.parts if isinstance(t, Chunked) else [t]
        if not self._slots or any(p.device.type != "cpu" for p in parts):
            return None
        ptrs = [p.data_ptr() for p in parts]
        spans = [_span(p) for p in parts]        # (each asked once: a third of a lend's time)
        blocks = [self._block_at(q, n) for q, n in zip(ptrs, spans)]
        inside = [k for k, b in enumerate(blocks) if b is not None]
        if not inside:
            return None
        start = min(ptrs[k] for k in inside)
        end = max(ptrs[k] + spans[k] for k in inside)
        slot = self._slots.pop()
        self.flags[slot] = HELD
        self._lent[slot] = [blocks[k] for k in inside]
        for b in self._lent[slot]:
            self._blocks[b][2] += 1
        self.pieces_lent += 1
        self.bytes_lent += sum(spans[k] for k in inside)
        ref = {"token": self.token.hex(), "offset": start - self._ptr, "nbytes": end - start,
               "dtype": str(t.dtype).removeprefix("torch."), "slot": slot}
        if isinstance(t, Chunked):
            ref["parts"] = [None if b is None else [q - start, list(p.shape), list(p.stride())]
                            for p, q, b in zip(parts, ptrs, blocks)]
            return ref
        ref["shape"] = list(t.shape)
        if not t.is_contiguous():
            ref["strides"] = list(t.stride())
        return ref

    def unlend(self, refs) -> None:
        """Take back pieces lent for a reply that will not be sent (its write failed)."""
        for ref in refs:
            self.flags[ref["slot"]] = FREE
        self.reclaim()

    def reclaim(self) -> int:
        """Take back the pieces the frontend released; the number taken back."""
        self._collect()
        if not self._lent:
            return 0
        slots = np.fromiter(self._lent, dtype=np.int64, count=len(self._lent))
        done = slots[self.flags[slots] == FREE]
        for slot in done.tolist():
            self._slots.append(slot)
            for off in self._lent.pop(slot):
                block = self._blocks[off]
                block[2] -= 1
                self._maybe_free(off, block)
        return len(done)

    # ---- clean marks -----------------------------------------------------------------------
    def mark_clean(self, ticket: int) -> None:
        """The request with `ticket` is admitted and has no error (so far)."""
        self.marks[ticket % MARKS] = ticket

    def unmark(self, ticket: int) -> None:
        """The request with `ticket` has an error: its frontend must fetch it."""
        if self.marks[ticket % MARKS] == ticket:
            self.marks[ticket % MARKS] = 0

    def offer(self) -> dict:
        """What a frontend needs to map the arena (and to know it is on the same host)."""
        return {"pid": os.getpid(), "fd": self.fd, "token": self.token.hex(), "size": self.size,
                "boot_id": _boot_id(), "allocated": self.allocated}

    def stats(self) -> dict[str, int]:
        self.reclaim()
        return {"arena_bytes": self.size, "arena_used_bytes": self.used,
                "arena_pieces_out": len(self._lent), "arena_pieces_lent": self.pieces_lent,
                "arena_bytes_lent": self.bytes_lent}



def _span(t: torch.Tensor) -> int | None:
    """Bytes from `t`'s first element to past its last (None: a negative stride)."""
    if t.numel() == 0 or any(st < 0 for st in t.stride()):
        return None if t.numel() else 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _close(fd: int, registered_ptr: int | None) -> None:
    if registered_ptr is not None:
        try:
            torch.cuda.cudart().cudaHostUnregister(registered_ptr)
        except Exception:        # interpreter shutdown: the process's exit frees it anyway
            pass
    try:
        os.close(fd)
    except OSError:
        pass


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error (a failed cudaHostRegister leaves it set, and torch
    reads it after its next kernel launch). Through the libcudart this process loaded."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            lib = next((line.split()[-1] for line in f if "libcudart" in line), None)
        if lib:
            ctypes.CDLL(lib).cudaGetLastError()
    except OSError:
        pass


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def make_arena(nbytes: int, device: torch.device) -> Arena | None:
    """An arena of `nbytes`, or None (logged once by the caller's fallback) when the system
    refuses the memory or the page-locking."""
    if nbytes < MIN_BLOCK_BYTES or not hasattr(os, "memfd_create"):
        return None
    try:
        return Arena(nbytes, device)
    except (OSError, RuntimeError, ValueError) as e:
        log.warning("vllm_hook: no shared result arena (%s); large results are written per fetch", e)
        return None


# ---- frontend ----------------------------------------------------------------------------
class FrontendArenas:
    """The arenas this frontend has mapped, by token, and the views of their lent pieces."""

    def __init__(self):
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray, str, tuple[int, int]]] = {}
        self._marks: dict[str, np.ndarray] = {}
        self._refused: set[str] = set()
        self._pieces: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def tokens(self) -> list[str]:
        """The mapped arenas whose workers still hold them. One whose worker exited or freed
        it is dropped here (not closed: results may still view it; its memory goes with the
        last view)."""
        for token, (_, _, path, ident) in list(self._maps.items()):
            try:
                st = os.stat(path)
                alive = (st.st_dev, st.st_ino) == ident
            except OSError:
                alive = False
            if not alive:
                del self._maps[token]
                self._marks.pop(token, None)
        return list(self._maps)

    def adopt(self, offer: dict | None) -> None:
        """Map an offered arena (once; a refusal is remembered: that worker keeps sending bytes)."""
        if not offer:
            return
        token = offer.get("token", "")
        if token in self._maps or token in self._refused:
            return
        try:
            if offer.get("boot_id") != _boot_id():
                raise OSError("the worker runs on another host")
            path = f"/proc/{int(offer['pid'])}/fd/{int(offer['fd'])}"
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size != int(offer["size"]):
                raise OSError("not the offered arena")
            fd = os.open(path, os.O_RDWR)
            try:
                # Not populated: mapping 4 GiB of page tables at once stalled the first fetch
                # (half a second); pages map as results are read.
                m = mmap.mmap(fd, int(offer["size"]), flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            if m[:TOKEN_BYTES].hex() != token:        # another process's file: pid or fd reused
                m.close()
                raise OSError("token mismatch")
            if offer.get("allocated"):
                # Its pages mapped into this process in the background: a lent piece read for
                # the first time took a page fault per 4 KiB in the results' conversion.
                populate_soon(m)
        except (OSError, ValueError, KeyError) as e:
            log.info("vllm_hook: cannot map a worker's result arena (%s); its results travel by copy", e)
            self._refused.add(token)
            return
        self._maps[token] = (m, np.frombuffer(m, dtype=np.uint8, count=SLOTS, offset=TOKEN_BYTES),
                             path, (st.st_dev, st.st_ino))
        self._marks[token] = np.frombuffer(m, dtype=np.uint64, count=MARKS, offset=MARKS_OFFSET)

    def clean(self, tokens: "tuple[str | None, ...]", ticket: int) -> bool:
        """Whether the request with `ticket` is marked clean in the arena of every rank
        (`tokens`: each rank's arena, from the last fetch; None: a rank without one)."""
        if not tokens or not ticket:
            return False
        for token in tokens:
            marks = self._marks.get(token) if token is not None else None
            if marks is None or int(marks[ticket % MARKS]) != ticket:
                return False
        return True

    def view(self, ref: dict) -> "torch.Tensor | list":
        """The lent piece `ref` as a tensor (writable: the caller's to keep); released to the
        worker when the last view of it is freed. Every call for one piece views one base, so
        the piece is released once, when the last of them goes. A reference to parts gives a
        list: each part's tensor, or None for a part sent by value."""
        key = (ref["token"], ref["slot"])
        arr = self._pieces.get(key)
        if arr is None:
            m, flags, _, _ = self._maps[ref["token"]]
            arr = np.frombuffer(m, dtype=np.uint8, count=ref["nbytes"], offset=ref["offset"])
            weakref.finalize(arr, _release, flags, ref["slot"])
            self._pieces[key] = arr
        dtype = getattr(torch, ref["dtype"])
        base = torch.from_numpy(arr)
        if "parts" in ref:
            return [None if p is None else base[p[0]:].view(dtype).as_strided(p[1], p[2])
                    for p in ref["parts"]]
        t = base.view(dtype)
        strides = ref.get("strides")
        return t.as_strided(ref["shape"], strides) if strides is not None else t.view(ref["shape"])

    def views(self, refs: dict[str, dict] | None) -> dict[str, torch.Tensor]:
        """A reply's lent pieces, viewed as soon as it arrives: whatever becomes of the reply
        (parsed, failed, dropped unread), each piece goes back when its views are freed."""
        out = {}
        for name, ref in (refs or {}).items():
            try:
                out[name] = self.view(ref)
            except KeyError:     # an arena this frontend no longer holds: nothing to release
                pass
        return out


def _release(flags: np.ndarray, slot: int) -> None:
    flags[slot] = FREE


FRONTEND = FrontendArenas()
