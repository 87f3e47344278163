"""Persistent device tables that the instrumented model reads and writes.

Allocated once, before vLLM compiles the model or captures CUDA graphs, and never replaced:
compiled code and graph replays hold their addresses. Routing changes per step by writing
their *contents* (see `worker/runtime.py`). Layout:

  op_idx  [T, L*K] int64   per batch row and (layer, op slot): row of `op_prm` (0 = identity)
  op_prm  [N+1, 4+K] fp32  per op: c_add*||v||, c_norm, c_abl, lo, hi, then u.u of the
                           request's earlier ops at that layer (row 0: 0, 0, 0, -inf, inf, 0..)
  op_vid  [N+1]    int64   per op: row of `unit`
  unit    [V+1, H] fp32    unit steering vectors (row 0: zeros)
  cap_idx [T, P]   int64   per batch row and capture point: destination row in its pool
                           (rows >= pool_rows are trash)
  pools   [R+64, W] model dtype  captured rows of the current step, one pool per row width
                           (residual H; q and k: their per-rank widths)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import HookConfig
from .layout import POOL_RESID, TRASH_ROWS, PointTable


@dataclass(frozen=True)
class BufferShape:
    num_layers: int
    hidden: int
    max_tokens: int
    max_ops: int
    max_vectors: int
    ops_per_layer: int
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
            pool_rows=cfg.capture_pool_rows or max(2 * max_num_batched_tokens, 8192),
            n_points=points.n_points,
            widths=(hidden, q_width if "q" in cfg.sites else 0, k_width if "k" in cfg.sites else 0),
        )


class HookBuffers:
    def __init__(self, shape: BufferShape, dtype: torch.dtype, device: torch.device):
        s = self.shape = shape
        self.dtype, self.device = dtype, device
        kw = dict(device=device)
        self.op_idx = torch.zeros(s.max_tokens, s.num_layers * s.ops_per_layer, dtype=torch.int64, **kw)
        self.op_prm = torch.zeros(s.max_ops + 1, 4 + s.ops_per_layer, dtype=torch.float32, **kw)
        self.op_prm[0, :5] = torch.tensor([0.0, 0.0, 0.0, -math.inf, math.inf])
        self.op_vid = torch.zeros(s.max_ops + 1, dtype=torch.int64, **kw)
        self.unit = torch.zeros(s.max_vectors + 1, s.hidden, dtype=torch.float32, **kw)
        self.cap_idx = torch.empty(s.max_tokens, s.n_points, dtype=torch.int64, **kw)
        self.cap_idx.copy_(self.trash_index(s.max_tokens).unsqueeze(1).expand(-1, s.n_points))
        self.pools = [torch.zeros(s.pool_rows + TRASH_ROWS, w, dtype=dtype, **kw) if w else None
                      for w in s.widths]
        self.pool = self.pools[POOL_RESID]

    def trash_index(self, n: int) -> torch.Tensor:
        return self.shape.pool_rows + torch.arange(n, device=self.device) % TRASH_ROWS

    def op_cols(self, layer: int) -> torch.Tensor:
        K = self.shape.ops_per_layer
        return self.op_idx[:, layer * K:(layer + 1) * K]

    def cap_col(self, col: int) -> torch.Tensor:
        return self.cap_idx[:, col]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.op_idx, self.op_prm, self.op_vid, self.unit, self.cap_idx, *self.pools)
                   if t is not None)
