"""`Results` computed with Hugging Face transformers instead of the engine.

For tests (the analyzers must give the same numbers on engine and HF results) and for trying an
analyzer on a model without starting vLLM. Needs `attn_implementation="eager"` (the only one
that returns attention weights); fp32 for a clean reference.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..results import Results

RESID_SITES = ("resid_post", "resid_pre", "attn_out", "mlp_out")


def _rows(tokens: Any, prompt_len: int, n: int) -> list[int]:
    if tokens == "last_prompt":
        return [prompt_len - 1]
    if tokens == "prompt":
        return list(range(prompt_len))
    if tokens == "all":
        return list(range(n))
    if tokens == "last":
        return list(range(prompt_len - 1, n))
    if tokens == "generated":
        return list(range(prompt_len, n))
    return sorted({p + prompt_len if p < 0 else p for p in tokens})


def _layers(layers: Any, n: int) -> list[int]:
    if layers == "all":
        return list(range(n))
    return sorted({L % n for L in ([layers] if isinstance(layers, int) else layers)})


def _heads(heads: Any, layer: int, n: int) -> list[int]:
    if heads == "all":
        return list(range(n))
    if isinstance(heads, dict):
        got = heads.get(str(layer), heads.get(layer))
        return list(range(n)) if got is None else list(got)
    return list(heads)


@torch.no_grad()
def hf_results(model, token_ids: Sequence[int], capture: Sequence[dict], *, prompt_len: int | None = None,
               request_id: str = "hf") -> Results:
    """Results for `capture` items (the request-spec format) from one HF forward over `token_ids`
    (prompt, plus generated tokens when `prompt_len` < len). `attn_scores` rows: prompt queries
    only, over the P prompt keys, as the engine returns them."""
    if getattr(model.config, "_attn_implementation", "eager") != "eager":
        raise ValueError("load the model with attn_implementation='eager' (the only HF attention that "
                         "returns weights)")
    ids = list(token_ids)
    P = len(ids) if prompt_len is None else prompt_len
    layers = model.model.layers
    nL, nH = len(layers), model.config.num_attention_heads
    got: dict[str, dict[int, torch.Tensor]] = {s: {} for s in RESID_SITES}
    hooks = []

    def out0(o):
        return (o[0] if isinstance(o, tuple) else o)[0].detach().clone()

    def pre(m, a, kw, i):
        got["resid_pre"][i] = (kw.get("hidden_states", a[0] if a else None))[0].clone()

    def post(site, i):
        return lambda m, a, o: got[site].__setitem__(i, out0(o))

    for i, layer in enumerate(layers):
        hooks += [
            layer.register_forward_pre_hook(lambda m, a, kw, i=i: pre(m, a, kw, i), with_kwargs=True),
            layer.register_forward_hook(post("resid_post", i)),
            layer.self_attn.register_forward_hook(post("attn_out", i)),
            layer.mlp.register_forward_hook(post("mlp_out", i)),
        ]
    try:
        out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    res = Results(request_id=request_id, prompt_len=P, token_ids=ids)
    heads_field: dict[str, dict[int, list[int]]] = {}
    for item in capture:
        site = item.get("site", "resid_post")
        default_tokens = "last_prompt" if site == "attn_scores" else "all"
        for L in _layers(item.get("layers", "all"), nL):
            if site == "attn_scores":
                rows = [p for p in _rows(item.get("tokens", default_tokens), P, len(ids)) if p < P]
                hs = _heads(item.get("heads", "all"), L, nH)
                a = out.attentions[L][0][hs][:, rows, :P]  # [n_h, n_q, P]
                res.activations.setdefault(site, {})[L] = a.permute(1, 0, 2).float().contiguous()
                heads_field.setdefault(site, {})[L] = hs
            elif site in RESID_SITES:
                rows = [p for p in _rows(item.get("tokens", default_tokens), P, len(ids)) if p < len(ids)]
                res.activations.setdefault(site, {})[L] = got[site][L][rows].float()
            else:
                raise ValueError(f"hf_results does not compute site {site!r}")
            res.positions.setdefault(site, {})[L] = torch.tensor(rows, dtype=torch.int64)
    # The `heads` field of Results (axis 1 of attn_scores); set as an attribute so this works
    # with Results classes from before the field existed.
    res.heads = heads_field
    return res
