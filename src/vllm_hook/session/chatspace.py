"""chatspace's API (`chatspace.generation`), so its scripts run with the import changed:

    from vllm_hook.session.chatspace import (VLLMSteerModel, VLLMSteeringConfig, SteeringSpec,
                                             LayerSteeringSpec, AddSpec, ProjectionCapSpec, AblationSpec)

    model = VLLMSteerModel(VLLMSteeringConfig(model_name="Qwen/Qwen3-0.6B"))
    spec = VLLMSteerModel.simple_steering(layer=12, vector=v, scale=4.0)
    texts, handles = await model.generate(prompts, sampling_params, steering_spec=spec, capture_layers=12)
    async with handles[0] as h:
        await h.fetch(); h.captures[12][0]["hidden"]

Underneath: an `AsyncSteerModel` over `vllm.AsyncLLM` (CUDA graphs kept, no enforce_eager),
each call's `steering_spec` sent as that request's spec. Captures arrive with the outputs, so
`fetch()` returns at once and there is no shared memory to release.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .chat import MessageBoundary
from .model import AsyncSteerModel, ChatResponse

__all__ = ["AblationSpec", "AddSpec", "CaptureHandle", "ChatResponse", "LayerSteeringSpec", "MessageBoundary",
           "ProjectionCapSpec", "SteeringSpec", "VLLMSteerModel", "VLLMSteeringConfig"]


@dataclass
class VLLMSteeringConfig:
    model_name: str = "Qwen/Qwen3-32B"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    dtype: str = "auto"
    bootstrap_layers: tuple[int, ...] = ()


@dataclass
class AddSpec:
    """h += scale * vector."""
    vector: torch.Tensor
    scale: float = 1.0


@dataclass
class ProjectionCapSpec:
    """The projection on `vector` clamped to [min, max]."""
    vector: torch.Tensor
    min: float | None = None
    max: float | None = None


@dataclass
class AblationSpec:
    """The component along `vector` multiplied by `scale`."""
    vector: torch.Tensor
    scale: float = 1.0


@dataclass
class LayerSteeringSpec:
    operations: list = field(default_factory=list)


@dataclass
class SteeringSpec:
    layers: dict[int, LayerSteeringSpec] = field(default_factory=dict)

    def ops(self) -> list[dict]:
        """Our spec's steering ops, layer by layer, each layer's in order."""
        out = []
        for layer in sorted(self.layers):
            for op in self.layers[layer].operations:
                v = torch.as_tensor(op.vector, dtype=torch.float32)
                if isinstance(op, AddSpec):
                    out.append({"op": "add", "layer": int(layer), "vector": v, "scale": float(op.scale)})
                elif isinstance(op, ProjectionCapSpec):
                    out.append({"op": "cap", "layer": int(layer), "vector": v, "min": op.min, "max": op.max})
                elif isinstance(op, AblationSpec):
                    out.append({"op": "ablate", "layer": int(layer), "vector": v, "scale": float(op.scale)})
                else:
                    raise TypeError(f"layer {layer}: unknown steering operation {type(op).__name__}")
        return out


class CaptureHandle:
    """One request's captures: `await fetch()` (or `async with`), then `captures[layer]` =
    `[{"hidden": tensor [prompt + generated - 1, hidden]}]`, `get_message_activations()`."""

    def __init__(self, request_id: str, layer_indices: tuple[int, ...], response: Any,
                 message_boundaries: tuple[MessageBoundary, ...] | None = None):
        self.request_id, self.layer_indices = request_id, layer_indices
        self.message_boundaries = message_boundaries
        self._response = response
        self._captures: dict | None = None

    async def __aenter__(self) -> "CaptureHandle":
        await self.fetch()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._captures, self._response = None, None

    async def fetch(self) -> dict[int, list[dict[str, Any]]]:
        if self._captures is None:
            if self._response is None:
                raise RuntimeError(f"capture handle of request {self.request_id} is closed")
            self._captures = {L: [{"hidden": t}] for L, t in self._response.captures.items()}
        return self._captures

    @property
    def captures(self) -> dict[int, list[dict[str, Any]]]:
        if self._captures is None:
            raise RuntimeError(f"captures of request {self.request_id} not fetched yet: await handle.fetch()")
        return self._captures

    def get_message_activations(self, message_idx: int, layer_idx: int, *, include_generated: bool = False):
        if self._captures is None:
            raise RuntimeError(f"captures of request {self.request_id} not fetched yet: await handle.fetch()")
        if not isinstance(self._response, ChatResponse):
            raise RuntimeError("message boundaries exist for chat() captures only")
        return self._response.get_message_activations(message_idx, layer_idx, include_generated=include_generated)


class VLLMSteerModel:
    """chatspace's `VLLMSteerModel` over vllm-hook (module docstring)."""

    def __init__(self, cfg: VLLMSteeringConfig, *, bootstrap_layers: Sequence[int] | None = None,
                 engine: Any = None, **vllm_kwargs: Any):
        for k in ("shm_ttl_seconds", "shm_max_gb", "decode_buffer_size"):   # chatspace's shared memory
            vllm_kwargs.pop(k, None)
        self.cfg = cfg
        if engine is None:
            # vLLM's public names (AsyncLLMEngine is the V1 AsyncLLM).
            from vllm import AsyncEngineArgs
            from vllm import AsyncLLMEngine as AsyncLLM

            args = dict(model=cfg.model_name, tensor_parallel_size=cfg.tensor_parallel_size,
                        gpu_memory_utilization=cfg.gpu_memory_utilization, dtype=cfg.dtype,
                        **({"max_model_len": cfg.max_model_len} if cfg.max_model_len else {}))
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**{**args, **vllm_kwargs}))
        self.llm = engine
        self._session = AsyncSteerModel(engine)

    @property
    def hidden_size(self) -> int:
        return self._session.hidden_size

    @property
    def layer_count(self) -> int:
        return self._session.layer_count

    @property
    def tokenizer(self) -> Any:
        return self._session.tokenizer

    def shutdown(self) -> None:
        self.llm.shutdown()

    @staticmethod
    def simple_steering(layer: int, vector: torch.Tensor, scale: float = 1.0) -> SteeringSpec:
        norm = float(vector.norm())
        unit = vector / norm if norm > 0 else vector
        return SteeringSpec({layer: LayerSteeringSpec([AddSpec(unit, norm * scale)])})

    @staticmethod
    def simple_projection_cap(layer: int, vector: torch.Tensor, min: float | None = None,
                              max: float | None = None) -> SteeringSpec:
        if min is None and max is None:
            raise ValueError("Must specify at least one of min or max")
        return SteeringSpec({layer: LayerSteeringSpec([ProjectionCapSpec(_unit(vector, "Projection cap"), min, max)])})

    @staticmethod
    def simple_ablation(layer: int, vector: torch.Tensor, scale: float = 1.0) -> SteeringSpec:
        return SteeringSpec({layer: LayerSteeringSpec([AblationSpec(_unit(vector, "Ablation"), scale)])})

    async def generate(self, prompts: str | list[str], sampling_params: Any = None, *,
                       capture_layers: int | Sequence[int] | None = None, steering_spec: SteeringSpec | None = None,
                       raw_output: bool = False, stream: bool = False, **kwargs: Any):
        """list[str] (or vLLM outputs with raw_output); with capture_layers, (that, handles)."""
        if stream:
            raise ValueError("stream=True is not supported here: use vllm_hook.AsyncClient.stream over a server")
        layers = _layers(capture_layers)
        got = await self._session.generate(prompts, sampling_params, capture_layers=layers,
                                           steering_spec=steering_spec, **kwargs)
        outs = [g.raw for g in got] if raw_output else [g.text for g in got]
        if layers is None:
            return outs
        return outs, [CaptureHandle(g.raw.request_id, tuple(layers), g) for g in got]

    async def chat(self, messages, sampling_params: Any = None, *, chat_options: dict | None = None,
                   capture_layers: int | Sequence[int] | None = None, steering_spec: SteeringSpec | None = None,
                   raw_output: bool = False, **sampling_kwargs: Any):
        """list[ChatResponse] (or vLLM outputs); with capture_layers, (that, handles)."""
        opts = dict(chat_options or {})
        cont = bool(opts.pop("continue_final_message", False))
        opts.pop("add_generation_prompt", None)       # follows continue_final_message
        layers = _layers(capture_layers)
        got = await self._session.chat(messages, sampling_params, capture_layers=layers, continue_final_message=cont,
                                       chat_template_kwargs=opts, steering_spec=steering_spec, **sampling_kwargs)
        outs = [g.raw for g in got] if raw_output else got
        if layers is None:
            return outs
        return outs, [CaptureHandle(g.raw.request_id, tuple(layers), g, tuple(g.message_boundaries)) for g in got]

    async def fetch_captures_batch(self, handles: Sequence[CaptureHandle]) -> None:
        for h in handles:
            await h.fetch()


def _unit(vector: torch.Tensor, what: str) -> torch.Tensor:
    norm = float(vector.norm())
    if norm == 0:
        raise ValueError(f"{what} vector must have nonzero norm")
    return vector / norm


def _layers(capture_layers) -> list[int] | None:
    if capture_layers is None:
        return None
    return [int(capture_layers)] if isinstance(capture_layers, int) else [int(x) for x in capture_layers]
