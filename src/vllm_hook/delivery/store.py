"""Captured rows of one request, on the host, until the frontend fetches them.

Rows arrive per step and per group of capture points with their token positions. A position
can arrive twice (a preempted request recomputes its tokens): the newest copy wins. The wire
format to the frontend is safetensors, one entry per group of points that share positions:
`g{p0}-{p1}-...` [points, rows, hidden] and `g{...}.pos` [rows]. It travels as bytes in the
RPC reply, or as a file in shared memory (`spill`).
"""

from __future__ import annotations

import json
import math
import warnings
import weakref
from typing import Any

import msgspec
import numpy as np
import torch
from safetensors.torch import save as st_save

try:                                   # safetensors >= 0.8: tensors described by pointer
    from safetensors import TensorSpec, serialize
except ImportError:                    # older: safetensors.torch.save
    TensorSpec = serialize = None

from . import spill as spill_mod
from .hostmem import CHUNK_BYTES, Chunked, Lazy, Rows, as_tensor, byte_views, copy_many, host_empty, write_views

_DTYPES = {name: dtype for dtype, name in spill_mod.ST_DTYPES.items()}


class Budget:
    """Host bytes that the stores sharing it may hold together (a worker's unfetched captures).
    A store's bytes return to it when the store is dropped, whichever path drops it."""

    def __init__(self, limit: int):
        self.limit, self.used = int(limit), 0

    def _release(self, held: list[int]) -> None:
        self.used -= held[0]
        held[0] = 0


class NotLent(Exception):
    """A payload made before a step's copies completed (`worker.runtime` prepares one while
    the device still runs the step) would read rows, not only lend them: not made."""


class RequestStore:
    """Chunks are kept as they arrive, one per step and group of points (point-major blocks,
    see `routing.Segment`); they are split per point only when the results are fetched, so a
    step costs one append per group, whatever the number of layers."""

    def __init__(self, budget: Budget | None = None):
        self._chunks: dict[tuple[int, ...], list[tuple[np.ndarray, torch.Tensor]]] = {}
        self._budget = budget
        self._held = [0]              # bytes, in a list: the finalizer must not keep self alive
        self.version = 0              # rows added so far: a payload made ahead is of this version
        self._finalized = False       # its finalizer made (with its first bytes)

    @property
    def nbytes(self) -> int:
        return self._held[0]

    def _count(self, n: int) -> None:
        if self._budget is not None:
            # Its finalizer made with its first bytes: most requests (steering only) never
            # hold any, and one at admission cost about 3 µs a request.
            if not self._finalized:
                self._finalized = True
                weakref.finalize(self, self._budget._release, self._held)
            self._budget.used += n
        self._held[0] += n

    def add(self, points: tuple[int, ...], positions: np.ndarray, rows: torch.Tensor,
            last_only: bool, blocked: bool = False) -> bool:
        """Keep the rows ([points * positions, ...] point-major; `blocked`: already [points,
        positions, ...], a strided view of a decode run's buffer, `delivery.runs`); False
        (nothing kept) when they would take the budget past its limit."""
        n = rows.numel() * rows.element_size()
        if self._budget is not None and self._budget.used + n > self._budget.limit:
            return False
        if not blocked:
            rows = rows.reshape(len(points), len(positions), *rows.shape[1:])
        chunks = self._chunks.setdefault(points, [])
        chunks.append((positions, rows))
        self._count(n)
        self.version += 1
        if last_only and len(chunks) > 2:
            # Keep the two newest: the very last forward may be vLLM's surplus step, trimmed later.
            for _, r in chunks[:-2]:
                self._count(-r.numel() * r.element_size())
            del chunks[:-2]
        return True

    def blocks(self, chunked: bool = False, views_only: bool = False) -> list[tuple[tuple[int, ...], np.ndarray, Any]]:
        """[(points, positions, rows [len(points), len(positions), ...])], positions ascending,
        newest copy of each. Rows are views of the stored blocks where no reordering is needed
        (the common case: one prefill chunk, or steps in order without recomputation); rows of
        several chunks are concatenated, or with `chunked` left as a `Chunked` of them (the
        fetch writes each part straight into its payload: one copy, not two). `views_only`:
        raise `NotLent` where the rows would be read (reordered)."""
        out = []
        for points, chunks in self._chunks.items():
            parts = [c[1] for c in chunks]           # each [G, its positions, ...]
            if len(parts) > 1 and any(p.dtype != parts[0].dtype for p in parts):
                # A step's block widened on the device and one that was not (a neighbour in
                # the model's dtype shared it: `Collector._wide_pools`): joined in the first
                # chunk's dtype (bf16 -> float32 -> bf16 is exact). Read here, not when added:
                # rows handed over early are read only once their copies are done.
                if views_only:
                    raise NotLent("chunks of two dtypes")
                parts = [p.to(parts[0].dtype) for p in parts]
            pos = np.concatenate([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
            # [G, rows of all chunks, ...]: each chunk is G blocks of its own row count
            blocks = Chunked(parts) if len(parts) > 1 else parts[0]
            if len(pos) > 1 and not bool(np.all(pos[1:] > pos[:-1])):
                # Recomputed or reordered positions: keep the newest copy of each, in order.
                if views_only:
                    raise NotLent("reordered rows")
                rev = pos[::-1]
                pos, first_in_rev = np.unique(rev, return_index=True)
                blocks = as_tensor(blocks)[:, torch.from_numpy(len(rev) - 1 - first_in_rev)]
            elif not chunked:
                blocks = as_tensor(blocks)
            out.append((points, pos, blocks))
        return out

    def points(self) -> dict[int, tuple[np.ndarray, torch.Tensor]]:
        """{point: (positions, rows)}: `blocks` split per point."""
        return {point: (pos, blocks[g]) for points, pos, blocks in self.blocks()
                for g, point in enumerate(points)}

    def _tensors(self, extra: dict[str, torch.Tensor] | None = None, pos_arrays: bool = False,
                 views_only: bool = False) -> dict[str, Any]:
        # Per group of points: its positions (int64) and its rows [points, rows, ...], the
        # points of a group back to back, so the frontend converts them in one copy. Rows of
        # several chunks stay a `Chunked` (`as_tensor` where a tensor is needed). With
        # `pos_arrays` positions stay numpy arrays (`batch_to_wire` joins them in one call).
        # `views_only`: rows are never read (`NotLent` where they would be).
        if len(self._chunks) == 1:
            # One group kept in one chunk (a last-token capture): its block as it is.
            (points, chunks), = self._chunks.items()
            if len(chunks) == 1 and len(chunks[0][0]) == 1:
                pos, rows = chunks[0]
                name = group_name(points)
                pos = pos.astype(np.int64, copy=False)
                tensors = {name + ".pos": pos if pos_arrays else torch.from_numpy(pos),
                           name: rows if rows.is_contiguous() else _copied(rows, views_only)}
                if extra:
                    tensors.update(extra)
                return tensors
        tensors = {}
        got = self.blocks(chunked=True, views_only=views_only)
        for points, pos, blocks in (sorted(got, key=lambda b: b[0]) if len(got) > 1 else got):
            name = group_name(points)
            pos = pos.astype(np.int64, copy=False)
            tensors[name + ".pos"] = pos if pos_arrays else torch.from_numpy(pos)
            tensors[name] = (blocks if isinstance(blocks, Chunked) or blocks.is_contiguous()
                             else _copied(blocks, views_only))
        tensors.update(extra or {})
        return tensors

    def to_bytes(self, meta: dict, extra: dict[str, torch.Tensor] | None = None) -> bytes:
        return st_bytes(self._tensors(extra), {"vllm_hook": json.dumps(meta)})

    def to_wire(self, meta: dict, spill: dict | None, extra: dict[str, torch.Tensor] | None = None
                ) -> dict[str, Any]:
        """{"path": file} in the frontend's spill directory when this process shares it
        (`spill.sees`), else {"blob": bytes}. `extra`: more tensors (hook results), whose
        names do not start with "p"."""
        if spill_mod.sees(spill):
            try:
                return {"path": spill_mod.write_spilled(
                    self._tensors(extra), {"vllm_hook": json.dumps(meta)}, spill["dir"])}
            except OSError:     # full (a container's small /dev/shm) or vanished: use the RPC
                pass
        return {"blob": self.to_bytes(meta, extra)}


def _copied(t: torch.Tensor, views_only: bool) -> torch.Tensor:
    if views_only:
        raise NotLent("strided rows")
    return t.contiguous()


_NOTHING = torch.zeros(8, dtype=torch.uint8)     # where an empty tensor's bytes "are"


def st_bytes(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """Safetensors bytes of host tensors (or `Chunked`), which may share memory: the bytes
    `safetensors.torch.save` makes. Its Python prepares each tensor through ctypes and numpy
    (about 80 µs a tensor on the CI machine: a 4-layer last-token result in 750 µs); its
    serializer is given the tensors' pointers directly (56 µs)."""
    tensors = {k: as_tensor(t).contiguous() for k, t in tensors.items()}
    if TensorSpec is None:
        return st_save(_unshared(tensors), metadata=metadata)
    specs = {}
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        name = _DTYPE_NAMES.get(t.dtype) or _DTYPE_NAMES.setdefault(t.dtype, str(t.dtype)[6:])
        specs[k] = TensorSpec(dtype=name, shape=tuple(t.shape),
                              data_ptr=t.data_ptr() if n else _NOTHING.data_ptr(), data_len=n)
    return bytes(serialize(specs, metadata=metadata))    # `tensors` keeps the memory alive


_DTYPE_NAMES: dict[torch.dtype, str] = {}


class Stacked(Lazy):
    """Tensors of one shape and dtype as one [len(parts), ...] tensor not yet copied together
    (a served result's layers of a site where they are apart: rows packed across a fetch's
    requests, `PACK_BELOW`): `StParts` writes each part to its place in the file."""

    __slots__ = ("parts", "shape", "dtype")

    def __init__(self, parts: list[torch.Tensor]):
        first = parts[0]
        # (a part of another shape or dtype would make a header that disagrees with the bytes)
        assert all(p.shape == first.shape and p.dtype == first.dtype for p in parts), "Stacked: unlike parts"
        self.parts = parts
        self.shape = torch.Size((len(parts), *first.shape))
        self.dtype = first.dtype

    def tensor(self) -> torch.Tensor:
        return torch.stack([as_tensor(p) for p in self.parts])


class StParts:
    """Safetensors bytes of host tensors not yet joined: their header and their memory, for a
    large served result a client reads from its file (`server.store`): written to the file
    straight from the tensors, where `st_bytes` made a bytes object of them first (fresh
    memory, its pages faulted in) that the API server then copied into the file: about 4 ms
    of its CPU for a 3.1 MB result on the CI machine. A `Stacked` tensor is written part by
    part: no stacked copy first, which was fresh memory too and a torch copy on each encoding
    thread (every such thread waking a team of torch's threads of its own). Tensors are laid
    out widest dtype first (as safetensors does; by name within a width it sorts too, which
    this does not need), so that each starts aligned."""

    __slots__ = ("header", "parts", "size")

    def __init__(self, tensors: dict[str, Any], metadata: dict[str, str]):
        tensors = dict(sorted(tensors.items(), key=lambda kv: -kv[1].dtype.itemsize))
        self.header, self.size = spill_mod.layout(tensors, metadata)
        # (a contiguous uint8 view, or rows of a lent part as they lie: strided; its offset)
        self.parts, at = [], len(self.header)
        for t in tensors.values():
            for part in _pieces(t):
                n = part.numel() * part.element_size()
                if n:
                    self.parts.append((part.view(-1).view(torch.uint8) if part.is_contiguous() else part, at))
                at += n

    def __len__(self) -> int:
        return self.size

    def write(self, fd: int) -> None:
        """Into file `fd`, from its start: the header and every part (strided rows through
        this thread's buffer, `byte_views`) in gathering write calls (`write_views`)."""
        write_views(fd, [memoryview(self.header), *byte_views([t for t, _ in self.parts])])

    def to_bytes(self) -> bytes:
        """The bytes, joined (a result kept in memory after all: no file could be written).
        A bytes object, which the server sends without a copy on its event loop."""
        # (strided rows through this thread's buffer, `byte_views`: joined at once, so reusing
        # it is safe; a fresh contiguous copy of each was the allocator's new pages)
        return b"".join([self.header, *byte_views([t for t, _ in self.parts])])


def _pieces(t: Any) -> list[torch.Tensor]:
    """The tensors `t`'s bytes are made of, in order: a `Stacked` tensor's parts, a `Rows`'
    pieces (rows as they lie in their parts), or `t` itself."""
    if isinstance(t, Stacked):
        return [q for p in t.parts for q in _pieces(p)]
    if isinstance(t, Rows):
        return t.pieces()
    return [as_tensor(t)]

# safetensors dtype -> numpy dtype of the same bytes (bfloat16 read as uint16, viewed after)
_NP = {k: np.dtype(v) for k, v in {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
                                   "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
                                   "U8": np.uint8, "BOOL": np.bool_}.items()}


def st_tensors(blob: bytes, widen: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Inverse of `st_bytes`: (tensors, metadata) of safetensors bytes, the header parsed once,
    each tensor writable and apart from `blob` (the widened ones views of one block, which
    each of them keeps alive), through numpy (safetensors' Python
    loader cost about 15 µs a tensor, most of a served result's decoding). `widen(metadata,
    name)`: that tensor, when bfloat16 or float16, comes back as float32 (exactly). Dtypes
    numpy lacks go through safetensors."""
    header, data = _header(blob)
    meta = header.pop("__metadata__", None) or {}
    if any(info["dtype"] not in _NP for info in header.values()):
        from safetensors.torch import load
        return load(bytes(blob)), meta
    buf = np.frombuffer(blob, dtype=np.uint8)           # read-only for bytes: read, not viewed
    wide = [name for name, info in header.items()
            if widen is not None and info["dtype"] in ("BF16", "F16") and widen(meta, name)]
    # The widened tensors in one block (one allocation, not one per tensor), from 1 MiB in
    # reused memory, huge-page backed from 4 MiB (`host_empty`): on a GPU host fresh pages'
    # faults were half the widening (run 162)
    block = host_empty((sum((header[n]["data_offsets"][1] - header[n]["data_offsets"][0]) // 2 for n in wide),),
                       torch.float32) if wide else None
    at, wide = 0, set(wide)
    out = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        code, shape = info["dtype"], info["shape"]
        dt = _NP[code]
        a = buf[data + start:data + end]
        if name in wide:
            # Widened in one pass from the bytes (a bfloat16 is a float32's upper half).
            # Torch's conversion took half the time on one thread, but only with its thread
            # count set to 1 around it: global state of the caller's process (stop 68)
            a = a.view(dt) if (data + start) % dt.itemsize == 0 else a.copy().view(dt)
            dst = block[at:at + a.size]
            at += a.size
            if code == "BF16":
                np.left_shift(a, 16, out=dst.numpy().view(np.uint32), dtype=np.uint32)
            else:
                dst.numpy()[:] = a
            out[name] = dst.view(shape)
        else:
            t = torch.from_numpy(a.copy().view(dt).reshape(shape))    # writable, aligned: the caller's
            out[name] = t.view(torch.bfloat16) if code == "BF16" else t
    return out, meta


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`safetensors.torch.save` refuses tensors that share memory (layers of one capture group
    share their positions): those are cloned. The pointer path copies each one as it is."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        if t.numel() and t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        out[k] = t
    return out


PACK_BELOW = 64 << 10      # tensors smaller than this are concatenated across a fetch's requests
_GROUP_NAMES: dict[tuple[int, ...], str] = {}
_GROUP_POINTS: dict[str, tuple[int, ...]] = {}


def group_name(points: tuple[int, ...]) -> str:
    """The wire name of a group of points' rows: `g3-8-15-25`."""
    name = _GROUP_NAMES.get(points)
    if name is None:
        name = "g" + "-".join(map(str, points))
        if len(_GROUP_NAMES) < 4096:
            _GROUP_NAMES[points] = name
    return name


def _group_points(name: str) -> tuple[int, ...] | None:
    """Inverse of `group_name` (None for other names: positions, hook results)."""
    got = _GROUP_POINTS.get(name)
    if got is None:
        if name[:1] != "g" or name.endswith(".pos"):
            return None
        got = tuple(int(x) for x in name[1:].split("-"))
        if len(_GROUP_POINTS) < 4096:
            _GROUP_POINTS[name] = got
    return got


def _axis(name: str) -> int:
    """The axis a tensor's rows lie along: 1 for a group's rows [points, rows, ...], else 0."""
    return 1 if name[:1] == "g" and not name.endswith(".pos") else 0


def batch_to_wire(parts: list[tuple[dict, dict[str, torch.Tensor]]], spill: dict | None,
                  common: dict | None = None, arena: Any = None, lend_only: bool = False) -> dict[str, Any]:
    """Several requests' results as one safetensors payload: one file (or one blob) per fetch,
    not per request. Small tensors of the same name, dtype and shape but their rows (a
    last-token capture of 4 layers is 2 of them per request: rows and positions) are
    concatenated across requests into one, each request's rows recorded in its metadata
    (`_packed`: name -> [first row, rows]); larger ones keep their own entry ("{j}/{name}"),
    written straight from where they are, or, when they lie in `arena` (`delivery.arena`,
    lending to this frontend; a `Chunked` as one reference to its parts, those not in the
    arena sent by value as "{j}/{name}#{k}"), sent as references to it ("lent": name ->
    reference, beside the payload, so the frontend views them as the reply arrives,
    `FrontendArenas.views`).
    `common`: metadata every request shares, sent once. `lend_only`: rows are lent or the
    payload is not made (`NotLent`): no tensor but positions goes by value, so it may be made
    before the device has written the rows (`worker.runtime`'s prepared replies).
    At 256 requests, per-tensor and per-file work was most of a small capture's delivery cost."""
    groups: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for j, (_, ts) in enumerate(parts):
        for name, t in ts.items():
            groups.setdefault(name, []).append((j, t))
    tensors: dict[str, torch.Tensor] = {}
    # name -> [requests, their first rows, their row counts]: columns, not a dict per request
    packed: dict[str, list[list[int]]] = {}
    refs: dict[str, dict] = {}
    try:
        _wire_tensors(groups, tensors, packed, refs, arena, lend_only)
    except NotLent:
        if refs:
            arena.unlend(refs.values())       # not sent: its pieces stay here
        raise
    # Per-request metadata as columns where every request has the field (ids, prompt
    # lengths), the rest per request where present: JSON of a dict per request was 7 µs a
    # request of a small capture's delivery (encoded and parsed).
    body: dict[str, Any] = {"rows": _columns([m for m, _ in parts]), "packed": packed}
    if common:
        body["common"] = common
    meta = {"vllm_hook": json.dumps(body)}
    extra = {"lent": refs} if refs else {}
    try:
        if spill_mod.sees(spill):
            try:
                return {"path": spill_mod.write_spilled(tensors, meta, spill["dir"]), **extra}
            except OSError:     # full (a container's small /dev/shm) or vanished: use the RPC
                pass
        return {"blob": st_bytes(tensors, meta), **extra}
    except BaseException:
        if refs:
            arena.unlend(refs.values())      # this reply is not sent: its pieces stay here
        raise


def _wire_tensors(groups: dict[str, list[tuple[int, Any]]], tensors: dict, packed: dict, refs: dict,
                  arena: Any, lend_only: bool) -> None:
    """`batch_to_wire`'s tensors, each name's packed across requests, lent or by value."""
    for name, items in groups.items():
        first, ax = items[0][1], _axis(name)
        only_lent = lend_only and not name.endswith(".pos")
        if isinstance(first, np.ndarray):         # positions (`RequestStore._tensors`)
            if len(items) > 1 and all(a.nbytes < PACK_BELOW for _, a in items):
                tensors[name] = torch.from_numpy(np.concatenate([a for _, a in items]))
                sizes = [len(a) for _, a in items]
                packed[name] = [[j for j, _ in items], np.cumsum([0, *sizes[:-1]]).tolist(), sizes]
                continue
            items = [(j, torch.from_numpy(a)) for j, a in items]
            first = items[0][1]
        if len(items) > 1 and _packable(items, first, ax):
            lent = _lend_rows(arena, items, only_lent) if arena is not None and ax == 1 else None
            if lent is not None:
                refs[name], order, t = lent
                packed[name] = [order, list(range(len(order))), [1] * len(order)]
                tensors.update(_by_value(name, refs[name], t, only_lent))
                continue
            if only_lent:
                raise NotLent(name)
            tensors[name] = torch.cat([as_tensor(t) for _, t in items], dim=ax)
            sizes = [t.shape[ax] for _, t in items]
            packed[name] = [[j for j, _ in items], np.cumsum([0, *sizes[:-1]]).tolist(), sizes]
        else:
            for j, t in items:
                ref = arena.lend(t) if (arena is not None and t.numel() * t.element_size() >= PACK_BELOW) else None
                if ref is None:
                    if only_lent:
                        raise NotLent(name)
                    tensors[f"{j}/{name}"] = t
                    continue
                refs[f"{j}/{name}"] = ref
                tensors.update(_by_value(f"{j}/{name}", ref, t, only_lent))


def _columns(metas: list[dict]) -> dict[str, Any]:
    """{"n": requests, "cols": {field: [value per request]}, "sparse": {j: {field: value}}}."""
    counts: dict[str, int] = {}
    for m in metas:
        for k in m:
            counts[k] = counts.get(k, 0) + 1
    full = [k for k, c in counts.items() if c == len(metas)]
    cols = {k: [m[k] for m in metas] for k in full}
    sparse = {}
    if len(full) < len(counts):
        for j, m in enumerate(metas):
            rest = {k: v for k, v in m.items() if k not in cols}
            if rest:
                sparse[str(j)] = rest
    return {"n": len(metas), "cols": cols, "sparse": sparse}


def _metas(body: dict) -> list[dict]:
    """Inverse of `_columns`: the per-request metadata dicts."""
    rows = body["rows"]
    cols, n = rows["cols"], rows["n"]
    if len(cols) == 2 and "req_id" in cols and "prompt_len" in cols:     # the common case
        metas = [{"req_id": r, "prompt_len": p} for r, p in zip(cols["req_id"], cols["prompt_len"])]
    else:
        names = list(cols)
        metas = [dict(zip(names, vals)) for vals in zip(*cols.values())] if names else [{} for _ in range(n)]
    for j, rest in rows["sparse"].items():
        metas[int(j)].update(rest)
    return metas


def _packable(items: list[tuple[int, Any]], first: Any, ax: int) -> bool:
    """Whether `items`' tensors differ only in their rows (along `ax`) and are each small."""
    shape, dtype = first.shape, first.dtype
    if len(shape) <= ax:
        return False
    limit = PACK_BELOW // dtype.itemsize
    # The common case first, in two set builds: every request's tensor of one shape and dtype
    # (a last-token capture's). The loop below was 5 µs a request.
    if len({t.shape for _, t in items}) == 1 and len({t.dtype for _, t in items}) == 1:
        return math.prod(shape) < limit
    head, tail = shape[:ax], shape[ax + 1:]
    for _, t in items:
        s = t.shape
        if t.dtype != dtype or len(s) != len(shape) or s[:ax] != head or s[ax + 1:] != tail or s.numel() >= limit:
            return False
    return True


def _by_value(name: str, ref: dict, t: Any, only_lent: bool = False) -> dict[str, torch.Tensor]:
    """The parts of a lent `Chunked` that are not in the arena, sent beside the reference
    as "{name}#{k}" (its k-th part); with `only_lent`, `NotLent` if there are any."""
    out = {f"{name}#{k}": t.parts[k] for k, part in enumerate(ref.get("parts", ())) if part is None}
    if out and only_lent:
        raise NotLent(name)
    return out


MAX_ROW_RUNS = 16


def _lend_rows(arena: Any, items: list[tuple[int, Any]], only_lent: bool = False
               ) -> tuple[dict, list[int], Any] | None:
    """Requests' one-row groups ([points, 1, ...]: a last-token capture) lent as one reference
    where they lie in `arena` back to back (a prefill step's block holds every request's rows
    in turn): a strided view [points, requests, ...] per run of neighbours, joined as a
    `Chunked` when there are several, rows outside the arena among them by value. Returns
    (reference, the requests in row order, what was lent), or None (the caller packs a copy):
    this skips the worker's concatenation and write and the frontend's read. `only_lent`:
    None rather than copy a run outside the arena."""
    ts = [t for _, t in items]
    if not all(isinstance(t, torch.Tensor) and t.shape[1] == 1 and t.is_contiguous() for t in ts):
        return None
    size = ts[0].numel() * ts[0].element_size()
    ptrs = [t.data_ptr() for t in ts]
    bases = [t.untyped_storage().data_ptr() for t in ts]     # neighbouring blocks: two runs
    order = sorted(range(len(ts)), key=ptrs.__getitem__)
    runs, first = [], 0
    for k in range(1, len(order) + 1):
        if k == len(order) or ptrs[order[k]] - ptrs[order[k - 1]] != size or bases[order[k]] != bases[order[k - 1]]:
            runs.append(order[first:k])
            first = k
    if len(runs) > MAX_ROW_RUNS:
        return None
    t0 = ts[0]
    width = math.prod(t0.shape[2:])
    views = []
    for run in runs:
        v = ts[run[0]].as_strided((t0.shape[0], len(run), *t0.shape[2:]),
                                  (width, t0.shape[0] * width, *t0.stride()[2:]))
        if len(run) > 1 and not arena.holds(v):
            if only_lent:
                return None
            v = v.contiguous()                 # by value: contiguous
        views.append(v)
    lendable = Chunked(views) if len(views) > 1 else views[0]
    ref = arena.lend(lendable)
    return None if ref is None else (ref, [items[i][0] for i in order], lendable)


def _converted(t: Any, dtype: str | None, pairs, copies: list) -> torch.Tensor:
    """Fresh host memory for `t` (a tensor or `Chunked`), float32 when `dtype` is "float32";
    `pairs(out)`, the copies that fill it, join `copies`: a payload's copies run together at
    the end of its parse (one `copy_many`: torch's threads woken once, not per request)."""
    out = host_empty(tuple(t.shape), torch.float32 if dtype == "float32" else t.dtype)
    copies += pairs(out)
    return out


def _header(buf: Any) -> tuple[dict, int]:
    """The JSON header of safetensors bytes and where their data starts. By msgspec (a
    4-layer result's 0.9 KB header: 3.4 µs, json.loads 9.2, on the CI machine; once for every
    served response a client reads); by the standard library what msgspec refuses (NaN, a
    byte-order mark, lone surrogates: none of them in a header this plugin writes)."""
    n = int.from_bytes(buf[:8], "little")
    raw = bytes(buf[8:8 + n])
    try:
        return _JSON.decode(raw), 8 + n
    except msgspec.DecodeError:
        return json.loads(raw), 8 + n


_JSON = msgspec.json.Decoder()


def safetensors_metadata(buf: Any) -> dict:
    """The `__metadata__` of safetensors bytes, without reading the tensors."""
    return _header(buf)[0].get("__metadata__", {}) or {}


def points_from_bytes(buf: Any) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]:
    """Inverse of `RequestStore.to_bytes` (bytes, or a uint8 tensor a spilled file was read
    into): {point: (positions, rows)} and the metadata. Rows are views of `buf`, not copies
    (read-only for bytes: copy them before writing); positions are copies. Other tensors
    (hook results) are copies, in the metadata under "tensors"."""
    return parse_batch(buf)[0]


def parse_batch(buf: Any, dtype: str | None = None, lent: dict[str, torch.Tensor] | None = None,
                lend_float32: bool = False, join: bool = True
                ) -> list[tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]]:
    """Every request of a payload (`batch_to_wire`, or one `to_bytes`): (points, metadata).

    With `dtype` ("float32" or "model"), the rows packed across requests are converted (or
    copied out of read-only bytes) once for the whole payload; each request's rows are then
    views of that fresh block, listed in its metadata's `_fresh` (points): `results.build`
    uses them as they are. Other rows are views of `buf`, as without `dtype`. `lent`: the
    payload's tensors lent from a worker's arena, already viewed ("{j}/{name}" -> tensor).
    `lend_float32` (a model computing in bf16 or fp16): lent float32 rows, which a worker
    widened on the device (`Collector._wide_pools`), are used as they are, as the model's
    dtype is with "model"; a float32 model's are copied, their arena range back at once.
    `join=False` (served): a request's rows lent as several parts (those not in the arena
    sent by value: views of `buf`), in `dtype` already, stay those parts (each point's rows
    a `hostmem.Rows`), written to the result's file from them (`StParts`) instead of joined
    here, on the API server's event loop."""
    export = memoryview(buf.numpy() if isinstance(buf, torch.Tensor) else buf)
    owned = isinstance(buf, torch.Tensor)
    header, data = _header(export)
    meta = json.loads((header.pop("__metadata__", None) or {}).get("vllm_hook", "{}"))
    # A fetch's payload (`batch_to_wire`), or one request's (`RequestStore.to_bytes`)
    metas, packed = (_metas(meta), meta["packed"]) if "rows" in meta else ([meta], {})
    common = meta.get("common") or {}
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in metas]
    lent = lent or {}
    by_value: dict[str, torch.Tensor] = {}        # parts of lent rows sent by value ("#k")
    shared: dict[str, torch.Tensor] = {}          # packed across the batch's requests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # bytes are read-only: those views are only read
        # Views of one storage, so tensors that lie back to back can be copied as one.
        base = buf if owned else torch.frombuffer(export, dtype=torch.uint8)
        for full, info in header.items():
            if full == spill_mod.PAD:
                continue
            j, _, name = full.rpartition("/")
            start, end = info["data_offsets"]
            dt, shape = _DTYPES[info["dtype"]], info["shape"]
            if end == start:
                t = torch.empty(shape, dtype=dt)
            elif (data + start) % dt.itemsize == 0:
                t = base[data + start:data + end].view(dt).view(shape)
            else:                                # unaligned for its dtype: a copy
                t = torch.frombuffer(export, dtype=dt, count=(end - start) // dt.itemsize,
                                     offset=data + start).view(shape).clone()
            if "#" in name:
                by_value[full] = t
            elif j or len(metas) == 1:
                tensors[int(j) if j else 0][name] = t.clone() if name.endswith(".pos") else t
            else:
                shared[name] = t
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []      # run at the end, together
    chunked_fresh: dict[int, set[str]] = {}
    lent_shared: set[str] = set()              # packed rows lent as one range (`_lend_rows`)
    for full, t in lent.items():
        j, _, name = full.rpartition("/")
        if isinstance(t, list):
            # Rows of several chunks (a prompt block and decode runs), lent part by part:
            # joined here, converted to `dtype` on the way, one copy per part; or, not to
            # join, left as they are (served: the result's file written from them, `StParts`)
            t = Chunked([by_value[f"{full}#{k}"] if p is None else p for k, p in enumerate(t)])
            keep = not join and j and (dtype == "model" or dtype == "float32" and t.dtype == torch.float32)
            if not keep:
                t = _converted(t, dtype, t.pairs, copies)
            if dtype is not None:
                chunked_fresh.setdefault(int(j) if j else -1, set()).add(name)
        if not j:
            shared[name] = t
            lent_shared.add(name)
            continue
        tensors[int(j)][name] = t
    fresh_rows = set()
    for name, t in shared.items():
        # Positions and hook results: the user's to keep and change; copied once for all.
        if _group_points(name) is None:
            shared[name] = t.clone()
        elif dtype is not None:
            if name in lent_shared and (dtype == "model" or name in chunked_fresh.get(-1, ()) or (
                    lend_float32 and t.dtype == torch.float32)):
                pass             # lent (writable, the user's) or already joined and converted
            elif dtype == "float32" or not owned:
                # converted or copied: split over threads when large (`copy_many`)
                shared[name] = _converted(t, dtype, lambda out, t=t: [(out, t)], copies)
            fresh_rows.add(name)
    metas = [{**common, **m} for m in metas] if common else metas
    # Each packed tensor split into its requests' pieces in one call (per point of a group):
    # per request, only dict entries remain.
    pieces: list[dict[str, Any]] = [{} for _ in metas]
    split: dict[str, tuple[list[int], tuple]] = {}
    for name, (js, ats, sizes) in packed.items():
        if any(a > b for a, b in zip(ats, ats[1:])):     # pieces in the order they lie
            order = sorted(range(len(js)), key=ats.__getitem__)
            js, sizes = [js[i] for i in order], [sizes[i] for i in order]
        t = shared[name]
        group = _group_points(name)
        split[name] = (js, torch.split(t, sizes) if group is None else
                       [torch.split(t[g], sizes) for g in range(len(group))])
    # The common case, each request's group rows and positions packed (a last-token capture):
    # its points straight from the split pieces, one shared `_fresh` set per group.
    pts_of: list[dict] = [{} for _ in metas]
    fresh_of: list[set | None] = [None] * len(metas)
    for name in [n for n in split if _group_points(n) is not None]:
        js, per_point = split.pop(name)
        group = _group_points(name)
        pos_js, pos_pieces = split.pop(name + ".pos", (None, None))
        if pos_js is None:
            pos_by_j = None
        elif pos_js == js:
            pos_by_j = pos_pieces
        else:
            at = {j: k for k, j in enumerate(pos_js)}
            pos_by_j = [pos_pieces[at[j]] for j in js]
        shared_fresh = frozenset(group) if name in fresh_rows else None
        for k, j in enumerate(js):
            pos = pos_by_j[k] if pos_by_j is not None else tensors[j][name + ".pos"]
            pts = pts_of[j]
            for point, pp in zip(group, per_point):
                pts[point] = (pos, pp[k])
            if shared_fresh is not None:
                fresh_of[j] = shared_fresh if fresh_of[j] is None else fresh_of[j] | shared_fresh
    for name, (js, got) in split.items():        # the rest: positions of unpacked rows, hooks
        for j, piece in zip(js, got):
            pieces[j][name] = piece
    out = []
    owned_rows = {int(j) for j, _, _ in (full.rpartition("/") for full in lent) if j}
    groups_of = {name: _group_points(name) for name in {n for ts in tensors for n in ts} | set(packed)}
    for j, (m, ts, got) in enumerate(zip(metas, tensors, pieces)):
        if j in owned_rows and all(all(p.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                                       for p in (t.parts if isinstance(t, Chunked) else (t,)))   # (`join`)
                                   for name, t in ts.items() if groups_of[name] is not None):
            m["_owned"] = True      # its rows are lent pieces: writable, the user's
        fresh: set[int] = set(fresh_of[j]) if fresh_of[j] is not None else set()
        pts, other = pts_of[j], {}
        if not got and not ts:                   # all packed: done above
            if fresh_of[j] is not None:
                m["_fresh"] = fresh_of[j]
            out.append((pts, m))
            continue
        for name, piece in got.items():
            group = groups_of[name]
            if group is None:
                if name.endswith(".pos"):
                    ts[name] = piece
                else:
                    other[name] = piece
                continue
            pos = got.get(name + ".pos")
            if pos is None:
                pos = ts[name + ".pos"]
            for point, rows in zip(group, piece):
                pts[point] = (pos, rows)
            if name in fresh_rows:
                fresh.update(group)
        for name, t in ts.items():
            group = groups_of[name]
            if group is not None:
                pos = ts.get(name + ".pos")
                if pos is None:
                    pos = got[name + ".pos"]
                if name in chunked_fresh.get(j, ()) or (
                        lend_float32 and t.dtype == torch.float32 and f"{j}/{name}" in lent):
                    fresh.update(group)  # joined and converted, or lent widened
                elif dtype == "float32" or (dtype == "model" and not owned and f"{j}/{name}" not in lent):
                    # The request's rows of every point of the group in one copy (the build's
                    # copy per point was 3x slower for a mixed batch's prompts, run 71).
                    t = _converted(t, dtype, lambda out, t=t: [(out, t)], copies)
                    fresh.update(group)
                for g, point in enumerate(group):
                    pts[point] = (pos, t[g] if isinstance(t, torch.Tensor) else t.row(g))
            elif not name.endswith(".pos"):
                other[name] = t.clone()          # hook results: the user's to keep and change
        if other:
            m["tensors"] = other
        if fresh:
            m["_fresh"] = fresh
        out.append((pts, m))
    copy_many(copies, parallel_from=CHUNK_BYTES)
    return out
