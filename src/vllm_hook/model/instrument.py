"""Put the hook math into a loaded vLLM model, before vLLM compiles it.

Each decoder layer (and, per the config, its attention and MLP submodules) gets a subclass of
its own class whose forward runs the original and then the hook math. The per-layer buffer
views are registered as (non-persistent) buffers, so Dynamo lifts them as graph inputs: every
layer's traced graph is identical and Inductor compiles it once (a Python int layer index in
the graph would make each layer a distinct graph and multiply compile time).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..adapters.model import (ATTN_NAMES, MLP_NAMES, InstrumentError, attention_widths, child, find_attention,
                              find_layers, local_layers)
from ..config import HookConfig
from ..spec.resolve import ModelInfo, steer_bound
from .buffers import BufferShape, HookBuffers
from .hook_point import hook_point
from .layout import POOL_K, POOL_Q, PointTable
from .steering import capture_rows, steer_delta

_SHARED = ("op_prm", "unit", "pool")


def _buf(module: nn.Module, name: str, t: torch.Tensor) -> None:
    module.register_buffer(f"_vh_{name}", t, persistent=False)


class _LayerHook:
    """Mixin placed before the decoder layer's class: steer, then capture resid_post."""

    _vh_num_ops: int = 0
    _vh_embed: bool = False
    _vh_projections: bool = False
    _vh_steer: bool = True
    _vh_bound: float = float("inf")
    _vh_hook_in: int = -1            # hook point before this layer (layer 0: the embeddings)
    _vh_hook_out: int = -1           # hook point after it
    _vh_owner: int = 0

    def forward(self, *args: Any, **kwargs: Any):
        if self._vh_embed or self._vh_hook_in >= 0:
            hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
            res = kwargs["residual"] if "residual" in kwargs else (args[2] if len(args) > 2 else None)
            if self._vh_hook_in >= 0:
                hook_point(hs, res, self._vh_hook_in, self._vh_owner)     # in place
            if self._vh_embed:
                x = hs if res is None else hs.float() + res.float()
                capture_rows(x, self._vh_embed_idx, self._vh_pool)
        out = super().forward(*args, **kwargs)
        # Order at a layer's output: Python hooks, the spec's steering ops, then captures.
        # Hooks come first so that an unused hook point adds no kernel: the steering and
        # capture math still fuses into the next layer's add+RMSNorm, past the graph split.
        if isinstance(out, tuple) and len(out) == 2 and out[1] is not None:
            hs, res = out
            if self._vh_hook_out >= 0:
                hook_point(hs, res, self._vh_hook_out, self._vh_owner)
            if self._vh_steer:
                stream = hs.float() + res.float()
                delta = steer_delta(stream, self._vh_op_idx, self._vh_op_prm, self._vh_unit,
                                    self._vh_num_ops, self._vh_projections, self._vh_bound)
                res = (res.float() + delta).to(res.dtype)
            # What the next layer reads: its fused add computes hs + res in fp32.
            capture_rows(hs.float() + res.float(), self._vh_cap_idx, self._vh_pool)
            return hs, res
        hs = out[0] if isinstance(out, tuple) else out
        if self._vh_hook_out >= 0:
            hook_point(hs, None, self._vh_hook_out, self._vh_owner)
        if self._vh_steer:
            stream = hs.float()
            delta = steer_delta(stream, self._vh_op_idx, self._vh_op_prm, self._vh_unit,
                                self._vh_num_ops, self._vh_projections, self._vh_bound)
            hs = (stream + delta).to(hs.dtype)
        capture_rows(hs, self._vh_cap_idx, self._vh_pool)
        return (hs, *out[1:]) if isinstance(out, tuple) else hs


class _OutputCapture:
    """Mixin for a sublayer (attention, MLP): capture its output, change nothing."""

    def forward(self, *args: Any, **kwargs: Any):
        out = super().forward(*args, **kwargs)
        x = out[0] if isinstance(out, tuple) else out
        capture_rows(x, self._vh_cap_idx, self._vh_pool)
        return out


class _QKCapture:
    """Mixin for vLLM's Attention module: capture its (post-RoPE) query and key inputs."""

    def forward(self, *args: Any, **kwargs: Any):
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        if self._vh_q:
            capture_rows(query.reshape(query.shape[0], -1), self._vh_q_idx, self._vh_pool_q)
        if self._vh_k:
            capture_rows(key.reshape(key.shape[0], -1), self._vh_k_idx, self._vh_pool_k)
        return super().forward(*args, **kwargs)


_CLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    if issubclass(cls, mixin):
        return
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Hooked{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    module.__class__ = _CLASSES[key]


def instrument(model: nn.Module, info: ModelInfo, cfg: HookConfig, *, max_num_batched_tokens: int,
               max_num_seqs: int, dtype: torch.dtype, hook_owner: int = 0
               ) -> tuple[HookBuffers, PointTable, list]:
    layers = find_layers(model)
    if len(layers) != info.num_layers:
        raise InstrumentError(f"found {len(layers)} decoder layers, config says {info.num_layers}")
    device = next(model.parameters()).device
    points = PointTable.for_config(info.num_layers, cfg)
    proj = cfg.layers_of(cfg.projection_layers, info.num_layers)
    steer = cfg.steering_layers(info.num_layers)
    wants_qk = "q" in cfg.sites or "k" in cfg.sites
    local = local_layers(layers)
    attns = [find_attention(layer) if i in local else None for i, layer in enumerate(layers)] if wants_qk else []
    first = next((a for a in attns if a is not None), None)
    q_width, k_width = attention_widths(first) if first is not None else (0, 0)
    shape = BufferShape.for_engine(num_layers=info.num_layers, hidden=info.hidden_size,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, cfg=cfg, points=points,
                                   q_width=q_width, k_width=k_width)
    bufs = HookBuffers(shape, dtype=dtype, device=device)
    boundaries = cfg.hook_boundaries(info.num_layers)
    for i, layer in enumerate(layers):
        if i not in local:                   # another pipeline stage's layer
            continue
        _swap_class(layer, _LayerHook)
        layer._vh_num_ops = shape.ops_per_layer
        layer._vh_projections = i in proj
        layer._vh_steer = i in steer
        layer._vh_bound = steer_bound(info, shape.ops_per_layer)
        if hook_owner:
            layer._vh_owner = hook_owner
            layer._vh_hook_in = 0 if i == 0 and 0 in boundaries else -1
            layer._vh_hook_out = i + 1 if i + 1 in boundaries else -1
        for name in _SHARED:
            _buf(layer, name, getattr(bufs, name))
        _buf(layer, "op_idx", bufs.op_cols(i))
        _buf(layer, "cap_idx", bufs.cap_col(points.col("resid_post", i)))
        if i == 0 and "resid_pre" in cfg.sites:
            layer._vh_embed = True
            _buf(layer, "embed_idx", bufs.cap_col(points.col("resid_pre", 0)))
        for site, names in (("attn_out", ATTN_NAMES), ("mlp_out", MLP_NAMES)):
            if points.has(site, i):
                sub = child(layer, names, site)
                _swap_class(sub, _OutputCapture)
                _buf(sub, "pool", bufs.pool)
                _buf(sub, "cap_idx", bufs.cap_col(points.col(site, i)))
        if attns and (points.has("q", i) or points.has("k", i)):
            attn = attns[i]
            _swap_class(attn, _QKCapture)
            attn._vh_q, attn._vh_k = points.has("q", i), points.has("k", i)
            if attn._vh_q:
                _buf(attn, "pool_q", bufs.pools[POOL_Q])
                _buf(attn, "q_idx", bufs.cap_col(points.col("q", i)))
            if attn._vh_k:
                _buf(attn, "pool_k", bufs.pools[POOL_K])
                _buf(attn, "k_idx", bufs.cap_col(points.col("k", i)))
    return bufs, points, attns
