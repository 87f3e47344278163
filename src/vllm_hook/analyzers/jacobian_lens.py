"""Jacobian lens: read each layer's residual stream through the model's average Jacobian.

A logit lens unembeds layer L's stream `h_L` as if it were the last layer's. The Jacobian
lens first transports it: `J_L` is the average, over the tokens of a prompt set, of the
Jacobian of the last decoder layer's output at a token with respect to layer L's output at
the same token (`d h_last[t] / d h_L[t]`, [hidden, hidden]). The readout is then
`lm_head(final_norm(J_L h_L))`; with `J_L = I` it is the plain logit lens (`baseline`).

- `fit` computes the Jacobians offline on a Hugging Face model (fp32; `torch.autograd`, one
  forward and one batched backward per token and layer). On the tiny CPU fixture it takes
  seconds; on a real model, fit on a GPU or on a handful of prompts.
- `readout_hook` reads them out inside the engine: a batched Python hook at the fitted
  layers that saves `layer{L}.ids` / `layer{L}.logprobs` (top-k, fp32) per forward pass, as
  the built-in `logit_lens` does.
- `hf_readout` is the same readout on the Hugging Face model, for checking.

The Jacobians are meaningful only on trained weights; on random ones the readout is noise.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..hooks.builtin import topk_logprobs
from ..hooks.hook import Hook


def _out(o):
    return o[0] if isinstance(o, tuple) else o


@torch.no_grad()
def _stream(model, ids: list[int]) -> list[torch.Tensor]:
    """Each decoder layer's output [T, hidden] on `ids`."""
    got: dict[int, torch.Tensor] = {}
    hs = [layer.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, _out(o)[0].clone()))
          for i, layer in enumerate(model.model.layers)]
    try:
        model(torch.tensor([ids]))
    finally:
        for h in hs:
            h.remove()
    return [got[i] for i in range(len(got))]


def fit(model, prompts: Sequence[Sequence[int]], layers: Iterable[int] | None = None,
        positions_per_prompt: int | None = None) -> dict[int, torch.Tensor]:
    """{layer: J_L [hidden, hidden]} averaged over every token of `prompts` (token id lists;
    with `positions_per_prompt`, the last that many tokens of each). The last layer's is the
    identity."""
    blocks = model.model.layers
    n = len(blocks)
    layers = sorted(set(range(n) if layers is None else (int(x) % n for x in layers)))
    out: dict[int, torch.Tensor] = {}
    for L in layers:
        if L == n - 1:
            hidden = model.config.hidden_size
            out[L] = torch.eye(hidden)
            continue
        total, count = None, 0
        for ids in prompts:
            ids = list(ids)
            clean = _stream(model, ids)[L]
            ts = range(len(ids)) if positions_per_prompt is None else range(max(0, len(ids) - positions_per_prompt), len(ids))
            for t in ts:
                J = _jacobian(model, ids, L, t, clean)
                total = J if total is None else total + J
                count += 1
        out[L] = total / count
    return out


def _jacobian(model, ids: list[int], L: int, t: int, clean: torch.Tensor) -> torch.Tensor:
    blocks = model.model.layers
    x = torch.tensor([ids])

    def f(v: torch.Tensor) -> torch.Tensor:
        final: dict[str, torch.Tensor] = {}

        def replace(m, a, o):
            h = _out(o)
            h = torch.cat([h[:, :t], v[None, None], h[:, t + 1:]], dim=1)
            return (h, *o[1:]) if isinstance(o, tuple) else h

        def keep(m, a, o):
            final["h"] = _out(o)[0, t]

        h1 = blocks[L].register_forward_hook(replace)
        h2 = blocks[-1].register_forward_hook(keep)
        try:
            model(x)
        finally:
            h1.remove()
            h2.remove()
        return final["h"]

    return torch.autograd.functional.jacobian(f, clean[t].clone(), vectorize=True)


def readout_hook(jacobians: dict[int, torch.Tensor], k: int = 5, baseline: bool = False) -> Hook:
    """A batched hook at the fitted layers: top-k next tokens of `J_L h_L` (of `h_L` with
    `baseline`), saved as `layer{L}.ids` and `layer{L}.logprobs`, one [rows, k] tensor per
    forward pass."""
    if not jacobians:
        raise ValueError("jacobians is empty: fit at least one layer")
    mats: dict[tuple[int, torch.device], torch.Tensor] = {}     # each on the device, once

    def fn(ctx, h):
        L = ctx.layer_idx
        x = h
        if not baseline:
            J = mats.get((L, h.device))
            if J is None:
                J = mats[(L, h.device)] = jacobians[L].to(device=h.device, dtype=torch.float32)
            x = (h.float() @ J.T).to(h.dtype)
        logits = torch.nn.functional.linear(ctx.final_norm(x), ctx.get_parameter("lm_head.weight"))
        ids, lps = topk_logprobs(logits, k)
        ctx.save(f"layer{L}.ids", ids)
        ctx.save(f"layer{L}.logprobs", lps)
        return None

    return Hook(fn, sorted(jacobians), batched=True, name="jacobian_lens")


@torch.no_grad()
def hf_readout(model, ids: list[int], jacobians: dict[int, torch.Tensor], k: int = 5,
               baseline: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (ids [T, k], logprobs [T, k])}: `readout_hook`'s numbers on the HF model."""
    stream = _stream(model, ids)
    out = {}
    for L, J in jacobians.items():
        x = stream[L] if baseline else stream[L] @ J.T
        logits = model.lm_head(model.model.norm(x)).float()
        top = logits.log_softmax(-1).topk(k, dim=-1)
        out[L] = (top.indices, top.values)
    return out
