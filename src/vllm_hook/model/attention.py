"""Attention weights recomputed outside the kernel, exactly as the kernel defines them.

    logits = scale * q.k      (then softcap * tanh(logits / softcap) where the model caps)
    masked: keys after the query (causal) and, with a sliding window W, keys with
            q_pos - k_pos >= W
    weights = softmax(logits) over the keys

Cost O(heads * keys * head_size) per query row: no full attention matrix is formed.
"""

from __future__ import annotations

import torch


# Query rows per chunk keep each chunk's logits near 64 MiB of fp32, whatever the prompt length
# (a 4,096-token prompt at 32 heads would otherwise form 2 GiB logits, and as much again for
# the mask and the softmax).
CHUNK_ELEMENTS = 16 << 20


def attention_scores(q: torch.Tensor, keys: torch.Tensor, kv_of_head: torch.Tensor,
                     q_pos: torch.Tensor, scale: float, softcap: float, window: int | None,
                     total_keys: int) -> torch.Tensor:
    """q [n, h, D] (selected heads), keys [K, kv_heads, D] for positions 0..K-1, kv_of_head [h]
    (the KV head each query head reads, GQA), q_pos [n]. Returns [n, h, total_keys] fp32, zero
    past each query's visible keys; computed in chunks of query rows (`CHUNK_ELEMENTS`)."""
    n, h = q.shape[0], q.shape[1]
    K = keys.shape[0]
    k = keys[:, kv_of_head].float()                                   # [K, h, D]
    out = torch.zeros(n, h, total_keys, dtype=torch.float32, device=q.device)
    kpos = torch.arange(K, device=q.device)
    step = max(1, CHUNK_ELEMENTS // max(h * K, 1))
    for a in range(0, n, step):
        logits = torch.einsum("nhd,khd->nhk", q[a:a + step].float(), k) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        qp = q_pos[a:a + step, None]
        hidden = kpos[None, :] > qp
        if window:
            hidden |= kpos[None, :] <= qp - window
        logits.masked_fill_(hidden[:, None, :], float("-inf"))
        out[a:a + step, :, :K] = torch.softmax(logits, dim=-1)
    return out
