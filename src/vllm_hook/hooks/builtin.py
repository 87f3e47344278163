"""Operator hooks every engine has: clients call them by name with JSON arguments.

    {"hooks": [{"name": "logit_lens", "args": {"layers": [4, 8], "k": 5}}]}
"""

from __future__ import annotations

from typing import Literal

import torch

from ..delivery.hostmem import upload
from . import kernels
from .context import BatchHookContext
from .hook import Hook
from .registry import operator_hook


def topk_logprobs(logits: torch.Tensor, k: int, chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probabilities in fp32) of the k largest entries of each row of `logits`
    [rows, vocab]. On a GPU the vocabulary is cut into `chunks` so that every kernel spreads
    rows x chunks slices over the SMs: a log-softmax or top-k with one block per row left an
    H200 mostly idle (1.3 ms per layer at 64 rows of a 152k vocabulary, docs/benchmarks.md).
    The top k lie in the k chunks of largest maxima; each chunk's log-sum-exp comes from one
    log-softmax over the chunk (lse_c = z_0 - log_softmax(z)_0, in fp32), the row's from one
    over the chunks' (lse = lse_c_0 - log_softmax(lse_c)_0). On a GPU with Triton and
    k <= 16, three kernels instead (`kernels.py`)."""
    if chunks is None and kernels.available(logits, k):
        return kernels.topk_logprobs(logits, k)
    n, v = logits.shape
    c = chunks if chunks is not None else (_chunks(v, k) if logits.is_cuda else 1)
    if c <= 1:
        top = logits.float().log_softmax(-1).topk(k, dim=-1)
        return top.indices, top.values
    if v % c or k > c:
        raise ValueError(f"chunks={c} must divide the vocabulary ({v}) and be at least k ({k})")
    w = v // c
    z = logits.view(n, c, w)
    lse_c = z[..., 0].float() - torch.log_softmax(z, -1, dtype=torch.float32)[..., 0]
    # The same trick over the chunks (torch.logsumexp is about ten kernels: 155 µs of host
    # time per call on the H200 host, against one log-softmax).
    lse = lse_c[:, :1] - torch.log_softmax(lse_c, -1)[:, :1]
    best = z.amax(-1).topk(k, dim=-1).indices                          # [n, k] chunks
    cand = torch.gather(z, 1, best[..., None].expand(n, k, w)).reshape(n, k * w)
    vals, at = cand.topk(k, dim=-1)
    ids = torch.gather(best, 1, torch.div(at, w, rounding_mode="floor")) * w + at % w
    return ids, vals.float() - lse


LENS_BLOCK_BYTES = 1 << 30     # logits (bf16) and their log-softmax (fp32) of one block of rows


def _lens(x: torch.Tensor, w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of x @ w.T by blocks of rows: a prefill step's rows of four layers would
    otherwise hold tens of GB of logits at once."""
    step = max(1, LENS_BLOCK_BYTES // (6 * w.shape[0]))
    if x.shape[0] <= step:
        return topk_logprobs(torch.nn.functional.linear(x, w), k)
    parts = [topk_logprobs(torch.nn.functional.linear(x[i:i + step], w), k) for i in range(0, x.shape[0], step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _chunks(v: int, k: int) -> int:
    """The most chunks (a power of two, at most 256) that divide `v`, or 1 below 16 or k."""
    c = 256
    while c > 1 and v % c:
        c //= 2
    return c if c >= max(16, k) else 1


@operator_hook("logit_lens")
def logit_lens(layers: list[int], k: int = 5, tokens: Literal["all", "last"] = "all") -> Hook:
    """Top-k next tokens read from each layer's residual stream (the model's final norm,
    then the unembedding): saved["layer{L}.ids"] and ["layer{L}.logprobs"], one [rows, k]
    tensor per forward pass ("last": only the last row of each pass).

    Read-only, so the unembedding waits for the last of `layers` in each forward pass: one
    final norm and one product with `lm_head` over the rows of every layer, not one per layer
    (the weight is read once; on a 1.5B model it is 466 MB)."""
    if not 1 <= k <= 1024:
        raise ValueError("k must be in 1..1024")
    if not layers:
        raise ValueError("layers must list at least one layer")
    waiting: list[tuple] = []       # (layer, normed rows, requests, segments) of this pass so far

    def fn(ctx, h):
        if getattr(ctx._params, "norm_elsewhere", False):
            raise ValueError(f"logit_lens at layer {ctx.layer_idx}: this pipeline stage has no final norm "
                             "(the last stage's); give the lens layers of the last stage")
        if tokens == "last" and len(ctx.segments) < h.shape[0]:
            ends = torch.tensor([a + n - 1 for a, n in ctx.segments])
            h = h.index_select(0, upload(ends, h.device))
        if waiting and waiting[-1][0] >= ctx.layer_idx:
            waiting.clear()          # a pass that never reached its last layer
        waiting.append((ctx.layer_idx, h, ctx.requests, ctx.segments))     # h: this call's own copy
        if ctx.num_layers and ctx.layer_idx != max(x % ctx.num_layers for x in layers):
            return None
        w = ctx.get_parameter("lm_head.weight")
        # The layers whose calls held the same requests share one product: the worker passes
        # one list object to every layer of a step (a new one once a request failed between).
        groups: dict[int, list] = {}
        for item in waiting:
            groups.setdefault(id(item[2]), []).append(item)
        waiting.clear()
        for items in groups.values():
            x = torch.cat([it[1] for it in items]) if len(items) > 1 else items[0][1]
            ids, lps = _lens(ctx.final_norm(x), w, k)      # one norm and one product for all layers
            rows = items[0][1].shape[0]
            for j, (L, _, reqs, segs) in enumerate(items):
                sub = BatchHookContext(reqs, segs, L, False, None)
                part = slice(j * rows, (j + 1) * rows)
                sub.save(f"layer{L}.ids", ids[part], per_request=tokens == "last")
                sub.save(f"layer{L}.logprobs", lps[part], per_request=tokens == "last")
        return None

    return Hook(fn, layers, batched=True, name="logit_lens", args={"layers": layers, "k": k, "tokens": tokens},
                read_only=True, graphable=True)


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

    return Hook(fn, layers, batched=True, name="stream_norms", args={"layers": layers}, read_only=True,
                graphable=True)
