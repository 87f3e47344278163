"""Captured rows of one request, on the host, until the frontend fetches them.

Rows arrive per step and per capture point with their token positions. A position can arrive
twice (a preempted request recomputes its tokens): the newest copy wins. The wire format to
the frontend is safetensors bytes: `p{point}` [rows, hidden] and `p{point}.pos` [rows].
"""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


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

    def to_bytes(self, meta: dict) -> bytes:
        tensors: dict[str, torch.Tensor] = {}
        for point, (pos, rows) in self.points().items():
            tensors[f"p{point}"] = rows.contiguous()
            tensors[f"p{point}.pos"] = torch.from_numpy(pos.astype(np.int64))
        return st_save(tensors, metadata={"vllm_hook": json.dumps(meta)})


def points_from_bytes(blob: bytes) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]:
    """Inverse of `RequestStore.to_bytes`: {point: (positions, rows)} and the metadata."""
    tensors = st_load(blob)
    meta = json.loads(_metadata(blob).get("vllm_hook", "{}"))
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".pos"):
            out[int(name[1:])] = (tensors[f"{name}.pos"], t)
    return out, meta


def _metadata(blob: bytes) -> dict:
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    return header.get("__metadata__", {}) or {}
