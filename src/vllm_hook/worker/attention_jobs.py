"""attn_scores: after the forward, from the query rows the model captured in-graph and the
keys in the paged KV cache (so chunked prefill and cached prefixes need no recompute)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..adapters.base import AttnLayer
from ..delivery.hostmem import upload
from ..model.attention import attention_scores
from ..routing import Segment, StepRouting
from ..spec.resolve import selected_mask


@dataclass(frozen=True)
class AttnJob:
    layer: int
    q_point: int            # capture point of the layer's query rows
    out_point: int          # virtual point the weights are stored under
    heads: tuple[int, ...]  # global query heads (union of the request's items at this layer)
    sels: tuple[tuple[str, tuple[int, ...]], ...]   # query-token selectors (union)


def scores_for_step(routing: StepRouting, q_pool: torch.Tensor, layers: list[AttnLayer]
                    ) -> list[tuple[Segment, torch.Tensor]]:
    out = []
    for seg in routing.segments:
        req = seg.owner
        if not req.attn_jobs:
            continue
        n = len(seg.positions)
        for g, point in enumerate(seg.points):
            for job in req.attn_jobs.get(point, ()):
                out.extend(_scores(req, job, seg, seg.pool_start + g * n, q_pool, layers))
    return out


def _scores(req, job: AttnJob, seg: Segment, start: int, q_pool: torch.Tensor, layers: list[AttnLayer]):
    """Weights of one job from the q rows at pool rows [start, start + len(seg.positions))."""
    m = np.zeros(len(seg.positions), dtype=bool)
    for sel, pos in job.sels:
        m |= selected_mask(sel, pos, seg.positions, req.prompt_len)
    info = layers[job.layer]
    local = [info.q_heads.index(h) for h in job.heads if h in info.q_heads]
    if not m.any() or not local:
        return []
    dev = q_pool.device
    rows = upload(torch.as_tensor(start + np.nonzero(m)[0]), dev)
    q = q_pool[rows].view(len(rows), info.num_heads, info.head_size)[:, local]
    qpos = seg.positions[m]
    group, block_size = info.geometry()
    K = int(qpos.max()) + 1
    pos = torch.arange(K, device=q_pool.device)
    blocks = upload(torch.as_tensor(req.blocks[group], dtype=torch.int64), dev)
    keys = info.keys(blocks[pos // block_size], pos % block_size)
    per_kv = info.num_heads // info.num_kv_heads
    kv_of_head = upload(torch.as_tensor([h // per_kv for h in local]), dev)
    w = attention_scores(q, keys, kv_of_head, upload(torch.as_tensor(qpos), dev),
                         info.scale, info.softcap, info.window, req.prompt_len)
    req.attn_heads[job.out_point] = [info.q_heads[h] for h in local]
    return [(Segment(req, (job.out_point,), 0, qpos, False), w)]
