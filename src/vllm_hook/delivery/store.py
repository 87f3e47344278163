"""Captured rows of one request, on the host, until the frontend fetches them.

Rows arrive per step and per capture point with their token positions. A position can arrive
twice (a preempted request recomputes its tokens): the newest copy wins. The wire format to
the frontend is safetensors: `p{point}` [rows, hidden] and `p{point}.pos` [rows]. It travels
as bytes in the RPC reply, or, when the frontend shares the worker's /dev/shm (the usual
case: same host and container), as a file there that the frontend maps and unlinks: large
captures then skip the RPC's serialisation and copies.
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import time
import uuid
import warnings
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
           "I32": torch.int32, "U8": torch.uint8}
SPILL_PREFIX = "vllm_hook-"


class RequestStore:
    """Chunks are kept as they arrive, one per step and group of points (point-major blocks,
    see `routing.Segment`); they are split per point only when the results are fetched, so a
    step costs one append per group, whatever the number of layers."""

    def __init__(self):
        self._chunks: dict[tuple[int, ...], list[tuple[np.ndarray, torch.Tensor]]] = {}
        self.nbytes = 0

    def add(self, points: tuple[int, ...], positions: np.ndarray, rows: torch.Tensor,
            last_only: bool) -> None:
        chunks = self._chunks.setdefault(points, [])
        chunks.append((positions, rows))
        self.nbytes += rows.numel() * rows.element_size()
        if last_only and len(chunks) > 2:
            # Keep the two newest: the very last forward may be vLLM's surplus step, trimmed later.
            for _, r in chunks[:-2]:
                self.nbytes -= r.numel() * r.element_size()
            del chunks[:-2]

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
            blocks = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            if len(pos) > 1 and not bool(np.all(pos[1:] > pos[:-1])):
                # Recomputed or reordered positions: keep the newest copy of each, in order.
                rev = pos[::-1]
                pos, first_in_rev = np.unique(rev, return_index=True)
                blocks = blocks[:, torch.from_numpy(len(rev) - 1 - first_in_rev)]
            for g, point in enumerate(points):
                out[point] = (pos, blocks[g])
        return out

    def _tensors(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for point, (pos, rows) in self.points().items():
            tensors[f"p{point}"] = rows.contiguous()
            tensors[f"p{point}.pos"] = torch.from_numpy(pos.astype(np.int64))
        return tensors

    def to_bytes(self, meta: dict) -> bytes:
        return st_save(self._tensors(), metadata={"vllm_hook": json.dumps(meta)})

    def to_wire(self, meta: dict, spill: dict | None) -> dict[str, Any]:
        """{"blob": bytes}, or {"path": file} when this process sees the frontend's probe file
        in the spill directory (`spill_target`): same host, same /dev/shm (a hostname alone
        does not prove that across containers)."""
        if spill and _sees(spill):
            path = os.path.join(spill["dir"], f"{SPILL_PREFIX}{uuid.uuid4().hex}.safetensors")
            try:
                st_save_file(self._tensors(), path, metadata={"vllm_hook": json.dumps(meta)})
                return {"path": path}
            except Exception:     # full (a container's small /dev/shm) or vanished: use the RPC
                if os.path.exists(path):
                    os.unlink(path)
        return {"blob": self.to_bytes(meta)}


_PROBES: dict[str, str] = {}


def spill_target(directory: str | None) -> dict | None:
    """What the frontend sends with a fetch: the directory to spill into and the name of an
    empty probe file it keeps there (re-made if swept), or None when it cannot write there."""
    if not directory:
        return None
    probe = _PROBES.get(directory)
    if probe is None or not os.path.exists(os.path.join(directory, probe)):
        probe = f"{SPILL_PREFIX}probe-{uuid.uuid4().hex}"
        path = os.path.join(directory, probe)
        try:
            open(path, "xb").close()
        except OSError:
            return None
        _PROBES[directory] = probe
        atexit.register(_remove, path)
    return {"dir": directory, "probe": probe}


def _sees(spill: dict) -> bool:
    d, probe = spill.get("dir") or "", spill.get("probe") or ""
    return (probe.startswith(SPILL_PREFIX) and os.path.exists(os.path.join(d, probe))
            and os.access(d, os.W_OK))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def sweep_spilled(directory: str, max_age_s: float) -> int:
    """Delete spilled files older than `max_age_s`: a frontend that died between a fetch and
    opening its file left them (a live one opens its files within the fetch)."""
    n, now = 0, time.time()
    try:
        names = [f for f in os.listdir(directory) if f.startswith(SPILL_PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            if now - os.path.getmtime(path) > max_age_s:
                os.unlink(path)                   # a live frontend re-makes its probe
                n += 1
        except OSError:
            pass                                  # another engine swept it first
    return n


def open_wire(entry: dict) -> Any:
    """The buffer of a fetched entry: the bytes, or the spilled file mapped and unlinked (the
    mapping lives as long as tensors viewing it)."""
    if "blob" in entry:
        return entry["blob"]
    with open(entry["path"], "rb") as f:
        # Populated up front: one call instead of a page fault per 4 KiB while reading.
        buf = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                        prot=mmap.PROT_READ)
    os.unlink(entry["path"])
    return buf


def _header(buf: Any) -> tuple[dict, int]:
    """The JSON header of safetensors bytes and where their data starts."""
    n = int.from_bytes(buf[:8], "little")
    return json.loads(bytes(buf[8:8 + n])), 8 + n


def safetensors_metadata(buf: Any) -> dict:
    """The `__metadata__` of safetensors bytes, without reading the tensors."""
    return _header(buf)[0].get("__metadata__", {}) or {}


def points_from_bytes(buf: Any) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]:
    """Inverse of `RequestStore.to_bytes` (bytes or a mapped file): {point: (positions, rows)}
    and the metadata. Rows are read-only views of `buf`, not copies; positions are copied."""
    header, data = _header(buf)
    meta = json.loads((header.pop("__metadata__", None) or {}).get("vllm_hook", "{}"))
    tensors = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # read-only buffer: the views are only read
        for name, info in header.items():
            start, end = info["data_offsets"]
            dtype, shape = _DTYPES[info["dtype"]], info["shape"]
            if end == start:
                t = torch.empty(shape, dtype=dtype)
            else:
                t = torch.frombuffer(buf, dtype=dtype, count=(end - start) // dtype.itemsize,
                                     offset=data + start).view(shape)
            tensors[name] = t.clone() if name.endswith(".pos") else t
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".pos"):
            out[int(name[1:])] = (tensors[f"{name}.pos"], t)
    return out, meta
