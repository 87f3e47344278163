"""Attention-kernel facts for `attn_scores`: scale, soft-cap, window, heads per rank, and
readers of the paged KV cache, whose physical layout belongs to the attention backend.

Supported layouts (anything else raises, naming the backend, instead of reading garbage):
  FLASH_ATTN (GPU): logical (num_blocks, kv_heads, block_size, 2 * head_size), K first.
  CPU_ATTN with isa "vec" (x86, block size a multiple of 32): per (block, kv head) a region
    of 2 * block_size * head_size values, K stored transposed [head_size, block_size], then V.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import AttnLayer


class UnsupportedAttention(RuntimeError):
    pass


def _backend_name(attn: Any) -> str:
    backend = getattr(attn, "attn_backend", None)
    try:
        return backend.get_name()
    except Exception:
        return type(getattr(attn, "impl", None)).__name__


def key_reader(attn: Any):
    name = _backend_name(attn)
    D = attn.head_size

    if name in ("FLASH_ATTN", "FLASH_ATTN_DIFFKV"):
        def keys(block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            kv = attn.kv_cache
            return kv[block_ids, :, offsets, :D]
        return keys
    if name == "CPU_ATTN":
        def keys(block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            isa = getattr(attn, "isa", None)
            if isa != "vec":
                raise UnsupportedAttention(
                    f"attn_scores on the CPU reads the 'vec' KV-cache layout; this engine uses "
                    f"'{isa}' (set block_size to a multiple of 32 and dtype float32 on x86)")
            kv = attn.kv_cache
            nb, kvh, bs = kv.shape[0], kv.shape[1], kv.shape[2]
            k = kv.reshape(nb, kvh, 2 * bs * D)[:, :, : bs * D].reshape(nb, kvh, D, bs)
            return k[block_ids, :, :, offsets]
        return keys

    def unsupported(*_):
        raise UnsupportedAttention(f"attn_scores cannot read the KV cache of attention backend {name}; "
                                   "supported: FLASH_ATTN (GPU) and CPU_ATTN")
    return unsupported


def layer_infos(attns: list, runner: Any, tp_rank: int, model_info: Any) -> list[AttnLayer | None]:
    """One per layer (None: the layer is another pipeline stage's)."""
    out: list[AttnLayer | None] = []
    for i, attn in enumerate(attns):
        if attn is None:
            out.append(None)
            continue
        impl = attn.impl
        nh, kvh = int(attn.num_heads), int(attn.num_kv_heads)
        total_kv = int(model_info.num_kv_heads)
        q_heads = [tp_rank * nh + j for j in range(nh)]
        # KV heads are replicated when there are fewer of them than TP ranks.
        kv0 = (q_heads[0] * total_kv) // int(model_info.num_heads)
        window = getattr(attn, "sliding_window", None) or getattr(impl, "sliding_window", None)
        if isinstance(window, tuple):  # FlashAttention stores (left, right)
            window = window[0] + 1 if window[0] >= 0 else None
        if window is not None and window < 0:
            window = None
        out.append(AttnLayer(
            layer=i, num_heads=nh, num_kv_heads=kvh, head_size=int(attn.head_size),
            scale=float(impl.scale), softcap=float(getattr(impl, "logits_soft_cap", 0) or 0),
            window=int(window) if window else None, q_heads=q_heads,
            kv_heads=[kv0 + j for j in range(kvh)], keys=key_reader(attn),
            geometry=_geometry(runner, attn.layer_name)))
    return out


def _geometry(runner: Any, layer_name: str):
    cache: dict = {}

    def geometry() -> tuple[int, int]:
        if not cache:
            for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
                if layer_name in group.layer_names:
                    cache["v"] = (g, int(group.kv_cache_spec.block_size))
                    break
            else:
                raise UnsupportedAttention(f"layer {layer_name} is in no KV cache group")
        return cache["v"]
    return geometry
