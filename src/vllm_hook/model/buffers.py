"""Persistent device tables that the instrumented model reads and writes.

Allocated once, before vLLM compiles the model or captures CUDA graphs, and never replaced:
compiled code and graph replays hold their addresses. Routing changes per step by writing
their *contents* (see `worker/runtime.py`). Layout:

  op_idx  [T, L*Ks] int64  per batch row and (layer, op slot): `pack_op(op row, vector row)`,
                           0 = identity; Ks = K rounded up to even (alignment, below). One
                           index gives both rows, so the kernel's two gathers do not wait on
                           each other (a chained op -> vector lookup showed up in the profile)
  op_prm  [N+1, 4+K] fp32  per op: c_add*||v||, c_norm, c_abl, lo, hi, then u.u of the
                           request's earlier ops at that layer (row 0: 0, 0, 0, -inf, inf, 0..)
  unit    [V+1, H] fp32    unit steering vectors (row 0: zeros)
  cap_idx [T, 2P]  int64   per batch row and capture point (column 2p): destination row in
                           its pool (rows >= pool_rows are trash); odd columns are padding
  pools   [R+64, W] model dtype  captured rows of the current step, one pool per row width
                           (residual H; q and k: their per-rank widths)

Every per-layer view starts 16-byte aligned (an even int64 column). Inductor compiles one
graph for all the identical layers, assuming its inputs aligned, and at run time clones any
input that is not: a view at an odd column made it copy the whole index buffer (3.8 MB) for
every second layer in every step (seen in an H200 profile, docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import HookConfig
from .layout import POOL_RESID, TRASH_ROWS, PointTable

INDEX_ALIGN = 2   # int64 columns per 16 bytes: Inductor's input-alignment unit (see above)


@dataclass(frozen=True)
class BufferShape:
    num_layers: int
    hidden: int
    max_tokens: int
    max_ops: int
    max_vectors: int
    ops_per_layer: int
    op_stride: int                    # op_idx columns per layer (ops_per_layer rounded up to even)
    pool_rows: int
    n_points: int
    widths: tuple[int, int, int]      # row width of the residual, q and k pools (0: no pool)

    @classmethod
    def for_engine(cls, *, num_layers: int, hidden: int, max_num_batched_tokens: int,
                   max_num_seqs: int, cfg: HookConfig, points: PointTable,
                   q_width: int = 0, k_width: int = 0) -> "BufferShape":
        K = cfg.max_ops_per_layer
        return cls(
            num_layers=num_layers,
            hidden=hidden,
            max_tokens=max_num_batched_tokens,
            # Every request may hold up to L*K ops; twice the batch leaves room for preempted ones.
            max_ops=2 * max_num_seqs * num_layers * K,
            max_vectors=cfg.max_vectors,
            ops_per_layer=K,
            op_stride=K + K % INDEX_ALIGN,
            pool_rows=cfg.capture_pool_rows or max(2 * max_num_batched_tokens, 8192),
            n_points=points.n_points,
            widths=(hidden, q_width if "q" in cfg.sites else 0, k_width if "k" in cfg.sites else 0),
        )


class HookBuffers:
    def __init__(self, shape: BufferShape, dtype: torch.dtype, device: torch.device):
        s = self.shape = shape
        self.dtype, self.device = dtype, device
        kw = dict(device=device)
        self.op_idx = torch.zeros(s.max_tokens, s.num_layers * s.op_stride, dtype=torch.int64, **kw)
        self.op_prm = torch.zeros(s.max_ops + 1, 4 + s.ops_per_layer, dtype=torch.float32, **kw)
        self.op_prm[0, :5] = torch.tensor([0.0, 0.0, 0.0, -math.inf, math.inf])
        self.unit = torch.zeros(s.max_vectors + 1, s.hidden, dtype=torch.float32, **kw)
        self.cap_idx = torch.empty(s.max_tokens, s.n_points * INDEX_ALIGN, dtype=torch.int64, **kw)
        self.cap_idx.copy_(self.trash_index(s.max_tokens).unsqueeze(1).expand_as(self.cap_idx))
        self.pools = [torch.zeros(s.pool_rows + TRASH_ROWS, w, dtype=dtype, **kw) if w else None
                      for w in s.widths]
        self.pool = self.pools[POOL_RESID]

    def trash_index(self, n: int) -> torch.Tensor:
        return self.shape.pool_rows + torch.arange(n, device=self.device) % TRASH_ROWS

    def op_cols(self, layer: int) -> torch.Tensor:
        start = op_col(self.shape, layer, 0)
        return self.op_idx[:, start:start + self.shape.ops_per_layer]

    def cap_col(self, point: int) -> torch.Tensor:
        return self.cap_idx[:, point * INDEX_ALIGN]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.op_idx, self.op_prm, self.unit, self.cap_idx, *self.pools)
                   if t is not None)


OP_ROW_BITS = 32


def pack_op(op_row: int, vec_row: int) -> int:
    """The op_idx entry of an op: its parameter row and its vector row in one int64."""
    return op_row | (vec_row << OP_ROW_BITS)


def op_col(shape: BufferShape, layer: int, slot: int) -> int:
    """Physical op_idx column of (layer, op slot)."""
    return layer * shape.op_stride + slot


def cap_points(cap_idx):
    """The logical [T, points] view of a capture index (host numpy or device tensor)."""
    return cap_idx[:, ::INDEX_ALIGN]
