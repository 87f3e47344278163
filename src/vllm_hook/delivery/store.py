"""Captured rows of one request, on the host, until the frontend fetches them.

Rows arrive per step and per capture point with their token positions. A position can arrive
twice (a preempted request recomputes its tokens): the newest copy wins. The wire format to
the frontend is safetensors: `p{point}` [rows, hidden] and `p{point}.pos` [rows]. It travels
as bytes in the RPC reply, or as a file in shared memory (`spill`).
"""

from __future__ import annotations

import json
import warnings
import weakref
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as st_save

from . import spill as spill_mod
from .hostmem import host_empty

_DTYPES = {name: dtype for dtype, name in spill_mod.ST_DTYPES.items()}


class Budget:
    """Host bytes that the stores sharing it may hold together (a worker's unfetched captures).
    A store's bytes return to it when the store is dropped, whichever path drops it."""

    def __init__(self, limit: int):
        self.limit, self.used = int(limit), 0

    def _release(self, held: list[int]) -> None:
        self.used -= held[0]
        held[0] = 0


class RequestStore:
    """Chunks are kept as they arrive, one per step and group of points (point-major blocks,
    see `routing.Segment`); they are split per point only when the results are fetched, so a
    step costs one append per group, whatever the number of layers."""

    def __init__(self, budget: Budget | None = None):
        self._chunks: dict[tuple[int, ...], list[tuple[np.ndarray, torch.Tensor]]] = {}
        self._budget = budget
        self._held = [0]              # bytes, in a list: the finalizer must not keep self alive
        if budget is not None:
            weakref.finalize(self, budget._release, self._held)

    @property
    def nbytes(self) -> int:
        return self._held[0]

    def _count(self, n: int) -> None:
        self._held[0] += n
        if self._budget is not None:
            self._budget.used += n

    def add(self, points: tuple[int, ...], positions: np.ndarray, rows: torch.Tensor,
            last_only: bool) -> bool:
        """Keep the rows; False (nothing kept) when they would take the budget past its limit."""
        n = rows.numel() * rows.element_size()
        if self._budget is not None and self._budget.used + n > self._budget.limit:
            return False
        chunks = self._chunks.setdefault(points, [])
        chunks.append((positions, rows))
        self._count(n)
        if last_only and len(chunks) > 2:
            # Keep the two newest: the very last forward may be vLLM's surplus step, trimmed later.
            for _, r in chunks[:-2]:
                self._count(-r.numel() * r.element_size())
            del chunks[:-2]
        return True

    def points(self) -> dict[int, tuple[np.ndarray, torch.Tensor]]:
        """{point: (positions, rows)}, positions ascending, newest copy of each. Rows are views
        of the stored blocks where no reordering is needed (the common case: one prefill
        chunk, or steps in order without recomputation)."""
        out = {}
        for points, chunks in self._chunks.items():
            G = len(points)
            parts = [c[1].reshape(G, len(c[0]), *c[1].shape[1:]) for c in chunks]
            pos = np.concatenate([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
            # [G, rows of all chunks, ...]: each chunk is G blocks of its own row count
            if len(parts) > 1:
                shape = (G, sum(p.shape[1] for p in parts), *parts[0].shape[2:])
                blocks = torch.cat(parts, dim=1, out=host_empty(shape, parts[0].dtype))
            else:
                blocks = parts[0]
            if len(pos) > 1 and not bool(np.all(pos[1:] > pos[:-1])):
                # Recomputed or reordered positions: keep the newest copy of each, in order.
                rev = pos[::-1]
                pos, first_in_rev = np.unique(rev, return_index=True)
                blocks = blocks[:, torch.from_numpy(len(rev) - 1 - first_in_rev)]
            for g, point in enumerate(points):
                out[point] = (pos, blocks[g])
        return out

    def _tensors(self, extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        # Positions first (int64: aligned from the 8-byte aligned data start), then the rows of
        # every point in point order: back to back in the file, so the frontend converts them
        # in one copy (`hostmem.coalesce`).
        pts = sorted(self.points().items())
        tensors = {f"p{point}.pos": torch.from_numpy(pos.astype(np.int64)) for point, (pos, _) in pts}
        tensors.update({f"p{point}": rows.contiguous() for point, (_, rows) in pts})
        tensors.update(extra or {})
        return tensors

    def to_bytes(self, meta: dict, extra: dict[str, torch.Tensor] | None = None) -> bytes:
        return st_save(self._tensors(extra), metadata={"vllm_hook": json.dumps(meta)})

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


PACK_BELOW = 64 << 10      # tensors smaller than this are concatenated across a fetch's requests


def batch_to_wire(parts: list[tuple[dict, dict[str, torch.Tensor]]], spill: dict | None) -> dict[str, Any]:
    """Several requests' results as one safetensors payload: one file (or one blob) per fetch,
    not per request. Small tensors of the same name, dtype and row shape (a last-token capture
    of 4 layers is 8 of them per request) are concatenated across requests into one, each
    request's rows recorded in its metadata (`_packed`: name -> [first row, rows]); larger
    ones keep their own entry ("{j}/{name}"), written straight from where they are. At 256
    requests, per-tensor and per-file work was most of a small capture's delivery cost."""
    groups: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for j, (_, ts) in enumerate(parts):
        for name, t in ts.items():
            groups.setdefault(name, []).append((j, t))
    tensors: dict[str, torch.Tensor] = {}
    packed: list[dict[str, list[int]]] = [{} for _ in parts]
    for name, items in groups.items():
        first = items[0][1]
        if len(items) > 1 and all(t.dim() >= 1 and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
                                  and t.numel() * t.element_size() < PACK_BELOW for _, t in items):
            tensors[name] = torch.cat([t for _, t in items])
            at = 0
            for j, t in items:
                packed[j][name] = [at, t.shape[0]]
                at += t.shape[0]
        else:
            tensors.update({f"{j}/{name}": t for j, t in items})
    meta = {"vllm_hook": json.dumps({"batch": [{**m, "_packed": pk} for (m, _), pk in zip(parts, packed)]})}
    if spill_mod.sees(spill):
        try:
            return {"path": spill_mod.write_spilled(tensors, meta, spill["dir"])}
        except OSError:     # full (a container's small /dev/shm) or vanished: use the RPC
            pass
    return {"blob": st_save(tensors, metadata=meta)}


def _header(buf: Any) -> tuple[dict, int]:
    """The JSON header of safetensors bytes and where their data starts."""
    n = int.from_bytes(buf[:8], "little")
    return json.loads(bytes(buf[8:8 + n])), 8 + n


def safetensors_metadata(buf: Any) -> dict:
    """The `__metadata__` of safetensors bytes, without reading the tensors."""
    return _header(buf)[0].get("__metadata__", {}) or {}


def points_from_bytes(buf: Any) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]:
    """Inverse of `RequestStore.to_bytes` (bytes, or a uint8 tensor a spilled file was read
    into): {point: (positions, rows)} and the metadata. Rows are views of `buf`, not copies
    (read-only for bytes: copy them before writing); positions are copies. Other tensors
    (hook results) are copies, in the metadata under "tensors"."""
    return parse_batch(buf)[0]


def parse_batch(buf: Any) -> list[tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]]:
    """Every request of a payload (`batch_to_wire`, or one `to_bytes`): (points, metadata)."""
    export = memoryview(buf.numpy() if isinstance(buf, torch.Tensor) else buf)
    header, data = _header(export)
    meta = json.loads((header.pop("__metadata__", None) or {}).get("vllm_hook", "{}"))
    metas = meta["batch"] if "batch" in meta else [meta]
    tensors: list[dict[str, torch.Tensor]] = [{} for _ in metas]
    shared: dict[str, torch.Tensor] = {}          # packed across the batch's requests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # bytes are read-only: those views are only read
        # Views of one storage, so tensors that lie back to back can be copied as one.
        base = buf if isinstance(buf, torch.Tensor) else torch.frombuffer(export, dtype=torch.uint8)
        for full, info in header.items():
            if full == spill_mod.PAD:
                continue
            j, _, name = full.rpartition("/")
            start, end = info["data_offsets"]
            dtype, shape = _DTYPES[info["dtype"]], info["shape"]
            if end == start:
                t = torch.empty(shape, dtype=dtype)
            elif (data + start) % dtype.itemsize == 0:
                t = base[data + start:data + end].view(dtype).view(shape)
            else:                                # unaligned for its dtype: a copy
                t = torch.frombuffer(export, dtype=dtype, count=(end - start) // dtype.itemsize,
                                     offset=data + start).view(shape).clone()
            if j or len(metas) == 1:
                tensors[int(j) if j else 0][name] = t.clone() if name.endswith(".pos") else t
            else:
                shared[name] = t
    out = []
    for m, ts in zip(metas, tensors):
        for name, (at, rows) in m.pop("_packed", {}).items():
            t = shared[name][at:at + rows]
            ts[name] = t.clone() if name.endswith(".pos") else t
        pts, other = {}, {}
        for name, t in ts.items():
            if name[:1] == "p" and name[1:].isdigit():
                pts[int(name[1:])] = (ts[f"{name}.pos"], t)
            elif not name.endswith(".pos"):
                other[name] = t.clone()          # hook results: the user's to keep and change
        if other:
            m["tensors"] = other
        out.append((pts, m))
    return out
