"""The model's structure as vLLM builds it: its decoder layers, which of them this worker
runs, their attention and MLP submodules, and the attention kernel module's head layout.
`model/instrument.py` swaps the classes of what these find; only here are vLLM's module and
attribute names read."""

from __future__ import annotations

from torch import nn

ATTN_NAMES = ("self_attn", "attn", "attention")
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "ffn")   # block_sparse_moe: Mixtral


class InstrumentError(RuntimeError):
    pass


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers: `model.model.layers` for the supported families."""
    inner = getattr(model, "model", None)
    for cand in (getattr(inner, "layers", None), getattr(model, "layers", None),
                 getattr(getattr(inner, "decoder", None), "layers", None)):
        if isinstance(cand, nn.ModuleList) and len(cand) > 0:
            return cand
    raise InstrumentError(
        f"vllm-hook cannot find the decoder layers of {type(model).__name__}; supported: "
        "models with model.layers (Llama, Mistral, Qwen2/3, Gemma/2/3, Phi-3 families)")


def local_layers(layers: nn.ModuleList) -> set[int]:
    """The indexes of the decoder layers this worker runs (with pipeline parallelism, the
    others are vLLM's PPMissingLayer placeholders)."""
    return {i for i, layer in enumerate(layers) if type(layer).__name__ != "PPMissingLayer"}


def child(layer: nn.Module, names: tuple[str, ...], site: str) -> nn.Module:
    for n in names:
        m = getattr(layer, n, None)
        if isinstance(m, nn.Module):
            return m
    raise InstrumentError(
        f"vllm-hook cannot find the {site} submodule of {type(layer).__name__}; start the engine "
        f"with additional_config vllm_hook.sites without {site!r}")


def find_attention(layer: nn.Module) -> nn.Module:
    """vLLM's Attention module of a decoder layer (the one that owns the KV cache)."""
    for m in child(layer, ATTN_NAMES, "attention").modules():
        if all(hasattr(m, a) for a in ("num_heads", "num_kv_heads", "head_size", "layer_name", "impl")):
            return m
    raise InstrumentError(f"vllm-hook cannot find the attention kernel module of {type(layer).__name__}; "
                          'start the engine with additional_config vllm_hook.sites without "q" and "k"')


def attention_widths(attn: nn.Module) -> tuple[int, int]:
    """(query width, key width) of one layer's rows: heads x head size on this worker."""
    return attn.num_heads * attn.head_size, attn.num_kv_heads * attn.head_size
