"""The math that runs inside the model, written as plain torch ops on persistent buffers.

Plain ops (no custom op) on purpose: vLLM compiles the model with Inductor, which fuses these
gathers, reductions and the row scatter into the kernels around them (the next layer's fused
add+RMSNorm), and writes the capture scatter straight into the pool (no copy of the buffer).
No Python branch depends on data, so the same code is valid in eager mode, under
torch.compile and in CUDA graphs.

Every steering op moves the stream along its unit vector u = v/||v||:
    x <- x + b*u,  b = c_add*||v|| + c_norm*||x|| + clamp(p, lo, hi) - p + c_abl*p,  p = x.u
add: c_add = s; add+norm_match: c_norm = s; cap: lo, hi; ablate: c_abl = s - 1.
Identity (row 0): all zero, lo = -inf, hi = +inf, so b is exactly 0.

Ops at one layer apply in order. Their projections need no second pass over the row: with
s_k = h.u_k and G_jk = u_j.u_k (per op pair, stored in the op row at admission),
    p_k = s_k + sum_{j<k} b_j G_jk,    ||x_{k+1}||^2 = ||x_k||^2 + 2 b_k p_k + b_k^2,
so one pass computes every s_k and ||h||^2, and one pointwise pass adds sum_k b_k u_k.

That pass is one extra reduction kernel per step, so it exists only at the layers the engine
enables for projections (cap, ablate, norm_match). Elsewhere b = c_add*||v||: no reduction,
and the update fuses into the next layer's add+RMSNorm kernel.

No op may move a row by more than `bound` (`spec.resolve.steer_bound`): additive ops are
refused beyond it at admission, and b of the stream-dependent ones is clamped to it here (a
NaN b, from a stream that is already non-finite, counts as 0). So the plugin never writes a
non-finite value into the residual stream, whatever a request asks for.
"""

from __future__ import annotations

import torch

from .buffers import OP_ROW_BITS

_ROW_MASK = (1 << OP_ROW_BITS) - 1
# Columns of the op-parameter table.
C_ADD, C_NORM, C_ABL, LO, HI, GRAM = 0, 1, 2, 3, 4, 5


def _gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] without a bounds check in the compiled kernel: the runtime writes only rows
    it allocated, and a device-side assert per load sits on the decode critical path."""
    return torch.ops.aten._unsafe_index.Tensor(table, [idx])


def steer_delta(
    h: torch.Tensor,          # [T, H] fp32 residual stream
    op_idx: torch.Tensor,     # [max_tokens, K] int64: this layer's op slots per row, packed
                              # op row | vector row << 32 (model.buffers.pack_op)
    op_prm: torch.Tensor,     # [N+1, 5 + K-1] fp32: c_add*||v||, c_norm, c_abl, lo, hi, G_k0..
    unit: torch.Tensor,       # [V+1, H] fp32 unit vectors (row 0: zeros)
    num_ops: int,
    projections: bool = True,
    bound: float = float("inf"),
) -> torch.Tensor:
    """Sum of this layer's updates for every row ([T, H]); exactly 0 for unsteered rows."""
    T = h.shape[0]
    oi = op_idx[:T]                                   # [T, K]
    prm = _gather(op_prm, oi & _ROW_MASK)             # [T, K, P]
    u = _gather(unit, oi >> OP_ROW_BITS)              # [T, K, H]
    if not projections:
        return (prm[:, :, C_ADD].unsqueeze(-1) * u).sum(dim=1)
    s = (h.unsqueeze(1) * u).sum(dim=-1)              # [T, K]
    n2 = (h * h).sum(dim=-1)                          # [T]
    betas: list[torch.Tensor] = []
    for k in range(num_ops):
        p = s[:, k]
        for j in range(k):
            p = p + betas[j] * prm[:, k, GRAM + j]
        n = torch.sqrt(torch.clamp(n2, min=0.0))
        b = (prm[:, k, C_ADD] + prm[:, k, C_NORM] * n
             + (torch.clamp(p, prm[:, k, LO], prm[:, k, HI]) - p) + prm[:, k, C_ABL] * p)
        b = torch.nan_to_num(b, nan=0.0).clamp(-bound, bound)
        n2 = n2 + 2.0 * b * p + b * b
        betas.append(b)
    return (torch.stack(betas, dim=1).unsqueeze(-1) * u).sum(dim=1)


def capture_rows(x: torch.Tensor, cap_idx: torch.Tensor, pool: torch.Tensor) -> None:
    """Scatter every row of `x` to its destination row of `pool` (trash rows for the rest)."""
    pool.index_copy_(0, cap_idx[: x.shape[0]], x.to(pool.dtype))
