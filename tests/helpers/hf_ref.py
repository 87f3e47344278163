"""Hugging Face transformers reference, fp32, eager attention: activations and steered greedy
generation computed the plain way (module hooks, full recompute every step)."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch


@functools.lru_cache(maxsize=4)
def load(path: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def layers(model):
    return model.model.layers


def _apply_ops(h: torch.Tensor, ops: list[dict], positions: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The documented steering formulas, on [T, H] rows in float64 for a clean reference."""
    h = h.double()
    for op in ops:
        sel = op.get("tokens", "all")
        m = _mask(sel, positions, prompt_len)
        v = torch.as_tensor(op["vector"], dtype=torch.float64)
        u = v / v.norm()
        x = h[m]
        if op["op"] == "add":
            if op.get("norm_match"):
                x = x + op.get("scale", 1.0) * x.norm(dim=-1, keepdim=True) * u
            else:
                x = x + op.get("scale", 1.0) * v
        elif op["op"] == "cap":
            p = x @ u
            lo = op.get("min", -float("inf"))
            hi = op.get("max", float("inf"))
            x = x + (p.clamp(lo, hi) - p)[:, None] * u
        elif op["op"] == "ablate":
            p = x @ u
            x = x + (op.get("scale", 0.0) - 1.0) * p[:, None] * u
        h[m] = x
    return h


def _mask(sel, positions: torch.Tensor, prompt_len: int) -> torch.Tensor:
    if sel == "all":
        return torch.ones_like(positions, dtype=torch.bool)
    if sel == "prompt":
        return positions < prompt_len
    if sel == "generated":
        return positions >= prompt_len
    if sel == "last_prompt":
        return positions == prompt_len - 1
    if sel == "last":
        return positions >= prompt_len - 1
    abs_pos = [p + prompt_len if p < 0 else p for p in sel]
    return torch.isin(positions, torch.tensor(abs_pos))


@contextmanager
def steering(model, ops: list[dict], prompt_len: int):
    """Forward hooks applying `ops` to decoder-layer outputs (resid_post), in spec order."""
    by_layer: dict[int, list[dict]] = {}
    n = len(layers(model))
    for op in ops:
        by_layer.setdefault(op["layer"] % n, []).append(op)
    handles = []
    for L, lops in by_layer.items():
        def hook(mod, args, out, lops=lops):
            hs = out[0] if isinstance(out, tuple) else out
            T = hs.shape[1]
            pos = torch.arange(T)
            new = _apply_ops(hs[0], lops, pos, prompt_len).to(hs.dtype)[None]
            return (new, *out[1:]) if isinstance(out, tuple) else new
        handles.append(layers(model)[L].register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def activations(model, ids: list[int], ops: list[dict] | None = None, prompt_len: int | None = None):
    """{site: {layer: [T, H] fp32}} for resid_post/resid_pre/attn_out/mlp_out, plus logits."""
    got: dict[str, dict[int, torch.Tensor]] = {"resid_post": {}, "resid_pre": {}, "attn_out": {}, "mlp_out": {}}
    handles = []
    for i, layer in enumerate(layers(model)):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: got["resid_pre"].__setitem__(i, (kw.get("hidden_states", a[0] if a else None))[0].clone()),
            with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(
            lambda m, a, o, i=i: got["attn_out"].__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].clone())))
        handles.append(layer.mlp.register_forward_hook(
            lambda m, a, o, i=i: got["mlp_out"].__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].clone())))
    P = prompt_len if prompt_len is not None else len(ids)
    try:
        with steering(model, ops or [], P):
            # Registered after steering hooks, so these see the steered output.
            for i, layer in enumerate(layers(model)):
                handles.append(layer.register_forward_hook(
                    lambda m, a, o, i=i: got["resid_post"].__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].clone())))
            out = model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return got, out.logits[0]


@torch.no_grad()
def greedy(model, prompt: list[int], steps: int, ops: list[dict] | None = None):
    """Greedy tokens with steering, recomputing the whole sequence each step; and last logits."""
    ids = list(prompt)
    logits = None
    with steering(model, ops or [], len(prompt)):
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], logits


_QK: dict = {}


def _recording_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    import sys

    _QK.setdefault("q", {})[module.layer_idx] = query[0].transpose(0, 1).clone()   # [T, H, D]
    _QK.setdefault("k", {})[module.layer_idx] = key[0].transpose(0, 1).clone()     # [T, Hkv, D]
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


@torch.no_grad()
def attention(model, ids: list[int]):
    """Post-RoPE q {layer: [T, H, D]}, k {layer: [T, Hkv, D]} and eager attention weights
    {layer: [H, T, T]} (output_attentions), fp32."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register("vh_record", _recording_attention)
    # Same (causal, sliding-window) masks as eager attention.
    ALL_MASK_ATTENTION_FUNCTIONS.register("vh_record", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    prev = model.config._attn_implementation
    model.set_attn_implementation("vh_record")
    _QK.clear()
    try:
        out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        model.set_attn_implementation(prev)
    q, k = dict(_QK["q"]), dict(_QK["k"])
    return q, k, {i: a[0] for i, a in enumerate(out.attentions)}


class HFAccess:
    """`ctx.get_parameter` and `ctx.final_norm` for hooks running on an HF model."""

    def __init__(self, model):
        self.model = model

    def __call__(self, name: str) -> torch.Tensor:
        return dict(self.model.named_parameters(remove_duplicate=False))[name]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(h)


@contextmanager
def python_hooks(model, hooks: list, prompt_len: int):
    """The same Python hooks on HF: fn(ctx, h) on the [T, H] rows of a layer's output (or,
    pre, input), the returned tensor replacing them; ctx is a real HookContext."""
    from vllm_hook.hooks.context import HookContext

    n = len(layers(model))
    handles, ctxs = [], []
    for hook in hooks:
        ctx = HookContext("hf", prompt_len, HFAccess(model))
        ctxs.append(ctx)
        for L in hook.layer_indices:
            L %= n

            def post(mod, args, out, hook=hook, ctx=ctx, L=L):
                hs = out[0] if isinstance(out, tuple) else out
                new = hook.fn(ctx._at(L, False, 0, hs.shape[1]), hs[0].clone())
                if new is None:
                    return None
                new = new[None].to(hs.dtype)
                return (new, *out[1:]) if isinstance(out, tuple) else new

            def pre(mod, args, kwargs, hook=hook, ctx=ctx, L=L):
                hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                new = hook.fn(ctx._at(L, True, 0, hs.shape[1]), hs[0].clone())
                if new is None:
                    return None
                new = new[None].to(hs.dtype)
                if "hidden_states" in kwargs:
                    return args, {**kwargs, "hidden_states": new}
                return (new, *args[1:]), kwargs

            if hook.pre:
                handles.append(layers(model)[L].register_forward_pre_hook(pre, with_kwargs=True))
            else:
                handles.append(layers(model)[L].register_forward_hook(post))
    try:
        yield ctxs
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def hooked_greedy(model, prompt: list[int], steps: int, hooks: list):
    """Greedy tokens under `hooks` (whole sequence recomputed each step); last logits."""
    ids = list(prompt)
    logits = None
    with python_hooks(model, hooks, len(prompt)):
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], logits
