"""What the frontend reads from vLLM's objects: the engine request (its prompt, sampling
params, prefix-cache salt) and the input processor (the engine's config), and the model facts
the spec is checked against. Plain attribute reads, here so that no module outside
`adapters/` depends on their names."""

from __future__ import annotations

from typing import Any

from ..spec.resolve import ModelInfo


def params_of(request: Any) -> Any:
    """The request's SamplingParams (None for pooling requests)."""
    return getattr(request, "sampling_params", None)


def prompt_len_of(request: Any) -> int:
    ids = request.prompt_token_ids
    return len(ids) if ids is not None else int(request.prompt_embeds.shape[0])


def resumable(request: Any) -> bool:
    """Whether a streamed input's later chunks continue the request (each resets max_tokens)."""
    return bool(getattr(request, "resumable", False))


def add_cache_salt(request: Any, salt: str) -> None:
    """Append `salt` to the request's prefix-cache salt: its KV blocks hash apart from others'."""
    request.cache_salt = f"{request.cache_salt}|{salt}" if request.cache_salt else salt


def input_processor_of(llm: Any) -> Any:
    """The InputProcessor of an offline `vllm.LLM` (where the frontend state lives)."""
    return llm.llm_engine.input_processor


def model_config_of(llm: Any) -> Any:
    """vLLM's ModelConfig of an offline `vllm.LLM`."""
    return llm.llm_engine.model_config


def engine_facts(input_processor: Any) -> tuple[Any, ModelInfo, int]:
    """(vllm_config, the model's facts, max_model_len) of the engine behind `input_processor`."""
    mc = input_processor.model_config
    return input_processor.vllm_config, model_info(mc), int(mc.max_model_len)


def forwards_drafts(vllm_config: Any) -> bool:
    """Whether the engine forwards tokens it may not keep: speculative decoding's draft tokens,
    a diffusion model's. Their positions can pass a request's max_tokens, and rejected ones
    are forwarded again: no route may end at the last position a request keeps."""
    return (getattr(vllm_config, "speculative_config", None) is not None
            or getattr(vllm_config, "diffusion_config", None) is not None)


def model_info(model_config: Any) -> ModelInfo:
    """The model facts specs are checked against, from vLLM's ModelConfig."""
    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    heads = int(getattr(hf, "num_attention_heads", 0) or 0)
    hidden = int(hf.hidden_size)
    return ModelInfo(
        num_layers=int(hf.num_hidden_layers),
        hidden_size=hidden,
        name=str(getattr(model_config, "model", "")),
        num_heads=heads,
        num_kv_heads=int(getattr(hf, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(hf, "head_dim", 0) or (hidden // heads if heads else 0)),
        dtype=str(getattr(model_config, "dtype", "float32")).removeprefix("torch."),
    )
