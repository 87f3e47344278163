"""Results through shared memory: a worker writes a request's safetensors into a file in
/dev/shm, the frontend reads it into its own memory and hands the file back for reuse (a file
too large to keep is mapped by the frontend instead, and deleted).

Only when the frontend shares the worker's /dev/shm (the usual case: same host and
container): the worker must see an empty probe file the frontend keeps there; a hostname
alone does not prove that across containers. Anything else (another host or container, an
unwritable directory, a full /dev/shm) travels as bytes in the RPC reply instead.

Why files are reused: writing into new tmpfs pages costs a page fault per 4 KiB page, several
times the copy itself (23 ms for a 42 MiB capture on the H200 host, `benchmarks/host_memory.py`).
A file handed back keeps its pages, so the next write into it is a plain copy. Handed-back
files are named `vllm_hook-free-{frontend pid}-*`; a worker claims one by renaming it (atomic,
so two workers never write one file). Up to `keep_limit` bytes of them are kept per directory;
the frontend deletes those still free when it exits, and stale ones are swept when an engine
starts.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import uuid
from typing import Any

import torch

from .hostmem import Chunked, host_empty, map_file, read_into, write_mapped, write_new

PREFIX = "vllm_hook-"
FREE = PREFIX + "free-"
# Handed-back files kept per directory, at most: 4 GiB, or a quarter of a smaller /dev/shm.
# Large enough for every layer and token of 32 x 512-token prompts of a 1.5B model (1.4 GB in
# bf16): a write into a reused file's pages took 190 ms per GiB on the CI machine, into fresh
# ones 460 ms (`benchmarks/host_memory.py`).
KEEP_FREE_BYTES = 4 << 30
MAPPED_FROM = 4 << 20  # payloads this large and up are written through a mapping (copies split over threads)
PAD = "__pad__"       # covers the unused tail of a reused, larger file: it stays valid safetensors
ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}

_PROBES: dict[str, str] = {}
_HANDING_BACK: set[str] = set()


# ---- frontend ------------------------------------------------------------------------------
def spill_target(directory: str | None) -> dict | None:
    """What the frontend sends with a fetch: the directory to spill into and the name of an
    empty probe file it keeps there (re-made if swept), or None when it cannot write there."""
    if not directory:
        return None
    probe = _PROBES.get(directory)
    if probe is None or not os.path.exists(os.path.join(directory, probe)):
        probe = f"{PREFIX}probe-{uuid.uuid4().hex}"
        path = os.path.join(directory, probe)
        try:
            open(path, "xb").close()
        except OSError:
            return None
        _PROBES[directory] = probe
        atexit.register(remove_quietly, path)
    return {"dir": directory, "probe": probe}


def open_entry(entry: dict) -> Any:
    """The buffer of a fetched entry: its bytes, or its spilled file as a uint8 tensor (results
    may view it). A file that could be kept for reuse is read into private huge-page memory
    and handed back; a larger one (over `keep_limit`, deleted after reading otherwise) is
    mapped instead of read, and deleted at once: the results view its pages (this process's
    alone now), which the kernel frees with the last view. That saves a copy of the whole
    payload (1.4 GB for every layer and token of 32 x 512-token prompts of a 1.5B model)."""
    if "blob" in entry:
        return entry["blob"]
    path = entry["path"]
    mapped = False
    try:
        with open(path, "r+b", buffering=0) as f:
            n = int.from_bytes(f.read(8), "little")
            pad = json.loads(f.read(n)).get(PAD)
            # A reused file may be much larger than this result: read up to its pad only.
            size = 8 + n + pad["data_offsets"][0] if pad else os.fstat(f.fileno()).st_size
            if size > keep_limit(os.path.dirname(path)):
                buf, mapped = map_file(f.fileno(), size), True
            else:
                buf = host_empty((size,), torch.uint8)
                read_into(f.fileno(), buf)
    finally:
        if mapped:
            remove_quietly(path)
        else:
            hand_back(path)
    return buf


def hand_back(path: str) -> None:
    """Offer a read file for reuse (deleted instead beyond the kept total)."""
    directory = os.path.dirname(path)
    try:
        kept = sum(size for size, _ in _free_files(directory))
        if kept + os.path.getsize(path) > keep_limit(directory):
            remove_quietly(path)
            return
        os.rename(path, os.path.join(directory, f"{FREE}{os.getpid()}-{uuid.uuid4().hex}"))
    except OSError:
        remove_quietly(path)
        return
    if directory not in _HANDING_BACK:
        _HANDING_BACK.add(directory)
        atexit.register(_remove_own_free_files, directory)


def keep_limit(directory: str) -> int:
    """How many bytes of handed-back files `directory` keeps: KEEP_FREE_BYTES, or a quarter
    of a smaller file system (a container's /dev/shm may hold 64 MiB)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return KEEP_FREE_BYTES
    return min(KEEP_FREE_BYTES, st.f_blocks * st.f_frsize // 4)


def _remove_own_free_files(directory: str) -> None:
    """At exit: the free files this process named (those no worker claimed since)."""
    mine = f"{FREE}{os.getpid()}-"
    for name in list_quietly(directory):
        if name.startswith(mine):
            remove_quietly(os.path.join(directory, name))


# ---- worker --------------------------------------------------------------------------------
def sees(spill: dict | None) -> bool:
    """Whether this process shares the frontend's spill directory (sees its probe file)."""
    if not spill:
        return False
    d, probe = spill.get("dir") or "", spill.get("probe") or ""
    return (probe.startswith(PREFIX) and os.path.exists(os.path.join(d, probe))
            and os.access(d, os.W_OK))


def write_spilled(tensors: dict[str, torch.Tensor], metadata: dict[str, str], directory: str) -> str:
    """Write `tensors` as safetensors into a reused or new file in `directory`; its path.
    Raises OSError (nothing left behind) when the directory is full or gone: new pages are
    allocated up front (fallocate), so a full tmpfs fails here, not part way."""
    header, size = layout(tensors, metadata)
    path = os.path.join(directory, f"{PREFIX}{uuid.uuid4().hex}.safetensors")
    capacity = _claim(directory, size, path)
    if capacity is not None and capacity > size:
        header, size = layout(tensors, metadata, pad_to=capacity)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if capacity is None or capacity < size:
                os.posix_fallocate(fd, 0, size)     # ENOSPC here, cleanly, when tmpfs is full
            elif capacity > size:
                os.ftruncate(fd, size)              # no room for the pad entry: a few bytes
            parts, offset = [(torch.frombuffer(bytearray(header), dtype=torch.uint8), 0)], len(header)
            chunked: list[tuple[Chunked, int]] = []
            for t in tensors.values():
                n = t.numel() * t.element_size()
                if n and isinstance(t, Chunked):
                    chunked.append((t, offset))
                elif n:
                    parts.append((t.contiguous().view(-1).view(torch.uint8), offset))
                offset += n
            if capacity is None or capacity < size or offset < MAPPED_FROM:
                # Fresh pages: the kernel's copy beats mapping them. A small payload: one
                # thread's copy either way, and pwrite skips the mapping's set-up and tear-down
                # (786 KiB: 45 against 94 to 108 µs on the CI machine).
                write_new(fd, parts + [(c.tensor().view(-1).view(torch.uint8), o) for c, o in chunked])
            else:
                # Only the bytes written are mapped: a reused file may be far larger than this
                # result (the pad covers the rest), and mapping all of it cost 100 ms for a
                # 1.4 GB file holding a few KiB (H200 host).
                write_mapped(fd, offset, parts, chunked)
        finally:
            os.close(fd)
        os.utime(path)
    except BaseException:
        remove_quietly(path)
        raise
    return path


def layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str],
            pad_to: int = 0) -> tuple[bytes, int]:
    """The safetensors header (8-byte length + JSON, space-padded to 8) and the file's size.
    With `pad_to`, a `__pad__` tensor fills the file up to that size where there is room."""
    entries, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + n]}
        offset += n
    entries["__metadata__"] = metadata

    def encode(pad: int | None, length: int = 0) -> bytes:
        extra = {} if pad is None else {PAD: {"dtype": "U8", "shape": [pad],
                                              "data_offsets": [offset, offset + pad]}}
        js = json.dumps({**entries, **extra}, separators=(",", ":")).encode()
        js += b" " * max(length - len(js), -len(js) % 8)
        return len(js).to_bytes(8, "little") + js

    header = encode(None)
    if pad_to:
        # The longest the header can be with a pad (its size has at most pad_to's digits).
        room = len(encode(pad_to))
        n = pad_to - room - offset
        if n > 0:
            return encode(n, room - 8), pad_to
    return header, len(header) + offset


def _claim(directory: str, size: int, path: str) -> int | None:
    """Rename a handed-back file to `path`: the smallest that holds `size` bytes, else the
    largest. Its size, or None when there is none to claim."""
    free = _free_files(directory)
    fits = sorted(f for f in free if f[0] >= size) or sorted(free, reverse=True)
    for cap, name in fits:
        try:
            os.rename(os.path.join(directory, name), path)
            return cap
        except OSError:          # another worker claimed it first
            continue
    return None


def sweep_spilled(directory: str, max_age_s: float) -> int:
    """Delete spilled files older than `max_age_s`: a frontend that died between a fetch and
    opening its file left them (a live one opens its files within the fetch), or free files
    nobody reused."""
    n, now = 0, time.time()
    for name in list_quietly(directory):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            if now - os.path.getmtime(path) > max_age_s:
                os.unlink(path)                   # a live frontend re-makes its probe
                n += 1
        except OSError:
            pass                                  # another engine swept it first
    return n


def _free_files(directory: str) -> list[tuple[int, str]]:
    """(size, name) of the handed-back files in `directory`."""
    out = []
    for name in list_quietly(directory):
        if name.startswith(FREE):
            try:
                out.append((os.path.getsize(os.path.join(directory, name)), name))
            except OSError:      # claimed or swept meanwhile
                pass
    return out


def list_quietly(directory: str) -> list[str]:
    """`directory`'s names, none where it cannot be listed."""
    try:
        return os.listdir(directory)
    except OSError:
        return []


def remove_quietly(path: str) -> None:
    """Unlink `path` if it is there (another process may have removed it first)."""
    try:
        os.unlink(path)
    except OSError:
        pass
