"""Attention weights recomputed outside the kernel, exactly as the kernel defines them.

    logits = scale * q.k      (then softcap * tanh(logits / softcap) where the model caps)
    masked: keys after the query (causal) and, with a sliding window W, keys with
            q_pos - k_pos >= W
    weights = softmax(logits) over the keys

Cost O(heads * keys * head_size) per query row: no full attention matrix is formed.
"""

from __future__ import annotations

import torch


def attention_scores(q: torch.Tensor, keys: torch.Tensor, kv_of_head: torch.Tensor,
                     q_pos: torch.Tensor, scale: float, softcap: float, window: int | None,
                     total_keys: int) -> torch.Tensor:
    """q [n, h, D] (selected heads), keys [K, kv_heads, D] for positions 0..K-1, kv_of_head [h]
    (the KV head each query head reads, GQA), q_pos [n]. Returns [n, h, total_keys] fp32, zero
    past each query's visible keys."""
    K = keys.shape[0]
    k = keys[:, kv_of_head].float()                                   # [K, h, D]
    logits = torch.einsum("nhd,khd->nhk", q.float(), k) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    kpos = torch.arange(K, device=q.device)
    hidden = kpos[None, :] > q_pos[:, None]
    if window:
        hidden |= kpos[None, :] <= q_pos[:, None] - window
    logits = logits.masked_fill(hidden[:, None, :], float("-inf"))
    w = torch.softmax(logits, dim=-1)
    if K == total_keys:
        return w
    out = torch.zeros(q.shape[0], q.shape[1], total_keys, dtype=w.dtype, device=w.device)
    out[..., :K] = w
    return out
