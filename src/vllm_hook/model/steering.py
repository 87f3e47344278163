"""The math that runs inside the model, written as plain torch ops on persistent buffers.

Plain ops (no custom op) on purpose: vLLM compiles the model with Inductor, which fuses these
gathers, reductions and the row scatter into the kernels around them (the next layer's fused
add+RMSNorm), so an unused hook costs no extra kernel under CUDA graphs, and the capture write
goes straight into the pool (Inductor re-inplaces it; no copy of the buffer). No Python branch
depends on data, so the same code is valid in eager mode, under torch.compile and in graphs.

Every steering op is one formula with per-row coefficients (u = v/||v||, p = h.u, n = ||h||):
    h <- h + c_add*v + (c_norm*n + clamp(p, lo, hi) - p + c_abl*p) * u
add: c_add = s; add+norm_match: c_norm = s; cap: lo, hi; ablate: c_abl = s - 1.
Identity (row 0): all zero, lo = -inf, hi = +inf, so the update is exactly 0.
"""

from __future__ import annotations

import torch


def steer_delta(
    h: torch.Tensor,          # [T, H] fp32 residual stream
    op_idx: torch.Tensor,     # [max_tokens, K] int64 (this layer's columns)
    op_prm: torch.Tensor,     # [N+1, 5] fp32
    op_vid: torch.Tensor,     # [N+1] int64
    vec: torch.Tensor,        # [V+1, H] fp32
    unit: torch.Tensor,       # [V+1, H] fp32
    num_ops: int,
) -> torch.Tensor:
    """Sum of the updates of this layer's op slots, applied in order. Exactly 0 when unused."""
    T = h.shape[0]
    delta = None
    for k in range(num_ops):
        oi = op_idx[:T, k]
        prm = op_prm[oi]
        vid = op_vid[oi]
        v = vec[vid]
        u = unit[vid]
        x = h if delta is None else h + delta
        p = (x * u).sum(dim=-1, keepdim=True)
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        coef = prm[:, 1:2] * n + (torch.clamp(p, prm[:, 3:4], prm[:, 4:5]) - p) + prm[:, 2:3] * p
        d = prm[:, 0:1] * v + coef * u
        delta = d if delta is None else delta + d
    assert delta is not None
    return delta


def capture_rows(x: torch.Tensor, cap_idx: torch.Tensor, pool: torch.Tensor) -> None:
    """Scatter every row of `x` to its destination row of `pool` (trash rows for the rest)."""
    pool.index_copy_(0, cap_idx[: x.shape[0]], x.to(pool.dtype))
