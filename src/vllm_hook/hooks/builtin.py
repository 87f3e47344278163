"""Operator hooks every engine has: clients call them by name with JSON arguments.

    {"hooks": [{"name": "logit_lens", "args": {"layers": [4, 8], "k": 5}}]}
"""

from __future__ import annotations

from typing import Literal

import torch

from .hook import Hook
from .registry import operator_hook


@operator_hook("logit_lens")
def logit_lens(layers: list[int], k: int = 5, tokens: Literal["all", "last"] = "all") -> Hook:
    """Top-k next tokens read from each layer's residual stream (the model's final norm,
    then the unembedding): saved["layer{L}.ids"] and ["layer{L}.logprobs"], one [rows, k]
    tensor per forward pass ("last": only the last row of each pass)."""
    if not 1 <= k <= 1024:
        raise ValueError("k must be in 1..1024")

    def fn(ctx, h):
        if tokens == "last":
            ends = torch.tensor([a + n - 1 for a, n in ctx.segments], device=h.device)
            h = h[ends]
        w = ctx.get_parameter("lm_head.weight")
        logits = torch.nn.functional.linear(ctx.final_norm(h), w).float()
        top = logits.log_softmax(-1).topk(k, dim=-1)
        if tokens == "last":
            for c, ids, lp in zip(ctx.requests, top.indices, top.values):
                c.saved.setdefault(f"layer{ctx.layer_idx}.ids", []).append(ids[None])
                c.saved.setdefault(f"layer{ctx.layer_idx}.logprobs", []).append(lp[None])
        else:
            ctx.save(f"layer{ctx.layer_idx}.ids", top.indices)
            ctx.save(f"layer{ctx.layer_idx}.logprobs", top.values)
        return None

    return Hook(fn, layers, batched=True, name="logit_lens", args={"layers": layers, "k": k, "tokens": tokens})


@operator_hook("zero_dims")
def zero_dims(layers: list[int], dims: list[int], pre: bool = False) -> Hook:
    """Set the residual stream's coordinates `dims` to 0 after (or, pre, before) `layers`:
    a neuron ablation in the residual basis."""
    if not dims:
        raise ValueError("dims must list at least one coordinate")
    index: dict = {}     # per device: a list index would be copied to the device every call

    def fn(ctx, h):
        if max(dims) >= h.shape[-1]:
            raise ValueError(f"dims go up to {max(dims)}, the stream has {h.shape[-1]}")
        idx = index.get(h.device)
        if idx is None:
            idx = index[h.device] = torch.tensor(dims, device=h.device)
        h.index_fill_(1, idx, 0)
        return h

    return Hook(fn, layers, pre=pre, batched=True, name="zero_dims",
                args={"layers": layers, "dims": dims, "pre": pre})


@operator_hook("stream_norms")
def stream_norms(layers: list[int]) -> Hook:
    """The L2 norm of every row of the residual stream at `layers`: saved["layer{L}"], one
    [rows] tensor per forward pass."""

    def fn(ctx, h):
        ctx.save(f"layer{ctx.layer_idx}", h.float().norm(dim=-1))
        return None

    return Hook(fn, layers, batched=True, name="stream_norms", args={"layers": layers})
