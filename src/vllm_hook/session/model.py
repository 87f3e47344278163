"""Steering sessions: a model object that holds steering state (chatspace-style).

`SteerModel(llm)` over `vllm.LLM` or a server (`vllm_hook.Client`), `AsyncSteerModel(engine)`
over `vllm.AsyncLLM` or `vllm_hook.AsyncClient`. All share the state (`state.SteeringState`)
and the request/response code here; only how a batch is run differs. Every request carries a snapshot of the state as its spec, so a change applies to
requests submitted after it, requests in flight keep theirs, and nothing locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..adapters.requests import model_config_of, model_info
from ..client import AsyncClient, Client
from ..results import ATTR, Results, results as results_of
from ..spec.schema import SPEC_KEY
from .chat import MessageBoundary, chat_prompt
from .state import SteeringState


@dataclass
class SteerResponse:
    text: str                          # generated text
    token_ids: list[int]               # generated tokens
    prompt_token_ids: list[int]
    results: Results | None = None     # captures: resid_post rows [prompt + generated - 1, hidden]
    raw: Any = None                    # vLLM's RequestOutput

    @property
    def captures(self) -> dict[int, torch.Tensor]:
        return dict(self.results.activations.get("resid_post", {})) if self.results else {}

    def activations(self, layer: int) -> torch.Tensor:
        return self.captures[layer]


@dataclass
class ChatResponse(SteerResponse):
    prefill: str = ""                  # the continued final message (continue_final_message)
    message_boundaries: list[MessageBoundary] = field(default_factory=list)

    @property
    def generated(self) -> str:
        return self.text

    def full_text(self) -> str:
        return self.prefill + self.text

    def to_message(self) -> dict:
        return {"role": "assistant", "content": self.full_text()}

    def get_message_activations(self, i: int, layer: int, include_generated: bool = False) -> torch.Tensor:
        """Rows of message i at `layer` (capture_layers must include it); with
        `include_generated`, followed by the rows of the generated tokens."""
        if self.results is None or layer not in self.captures:
            raise KeyError(f"layer {layer} was not captured; pass capture_layers=[..., {layer}]")
        b = self.message_boundaries[i]
        pos = self.results.positions["resid_post"][layer]
        keep = (pos >= b.start) & (pos < b.end)
        if include_generated:
            keep |= pos >= len(self.prompt_token_ids)
        return self.captures[layer][keep]


class _Session:
    """What the sync and async sessions share: the state, its setters, request building."""

    def __init__(self, hidden_size: int, layer_count: int, tokenizer: Any):
        self.hidden_size, self.layer_count = int(hidden_size), int(layer_count)
        self._tokenizer = tokenizer
        self.state = SteeringState(self.hidden_size, self.layer_count)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise ValueError("chat() over a server builds the prompt here: pass tokenizer= (a Hugging Face "
                             "tokenizer or the model's path) to the session")
        return self._tokenizer

    # chatspace names
    def set_layer_vector(self, layer: int, vector, scale: float = 1.0, norm_match: bool = False, tokens="all"):
        self.state.set_vector(layer, vector, scale, norm_match, tokens)

    def set_layer_projection_cap(self, layer: int, vector, min: float | None = None, max: float | None = None,
                                 tokens="all"):
        self.state.set_cap(layer, vector, min, max, tokens)

    def set_layer_ablation(self, layer: int, vector, scale: float = 0.0, tokens="all"):
        self.state.set_ablation(layer, vector, scale, tokens)

    def clear_layer_vector(self, layer: int):
        self.state.clear(layer, "add")

    def clear_layer_projection_cap(self, layer: int):
        self.state.clear(layer, "cap")

    def clear_layer_ablation(self, layer: int):
        self.state.clear(layer, "ablate")

    def clear_all_vectors(self):
        self.state.clear()

    def apply_steering_spec(self, spec) -> None:
        self.state.apply(spec)

    def export_steering_spec(self) -> dict:
        return self.state.export()

    def push_steering_spec(self, spec=None) -> None:
        self.state.push(spec)

    def pop_steering_spec(self) -> None:
        self.state.pop()

    # requests
    def _spec(self, capture_layers, steering_spec: Any = None) -> dict:
        """The spec of a request submitted now: the state's snapshot, then this call's
        `steering_spec` ops ({"steer": [...]}), and the captures."""
        spec: dict = {}
        ops = self.state.steer_ops() + _call_ops(steering_spec)
        if ops:
            spec["steer"] = ops
        if capture_layers:
            spec["capture"] = [{"site": "resid_post", "layers": list(capture_layers), "tokens": "all"}]
        return spec

    def _params(self, sampling_params, sampling: dict, capture_layers, steering_spec: Any = None) -> Any:
        from vllm import SamplingParams

        sp = sampling_params.clone() if sampling_params is not None else SamplingParams(**sampling)
        spec = self._spec(capture_layers, steering_spec)
        if spec:
            sp.extra_args = {**(sp.extra_args or {}), SPEC_KEY: spec}
        return sp

    def _chat_inputs(self, conversations, continue_final_message: bool, template_kw: dict):
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else list(conversations)
        built = [chat_prompt(self.tokenizer, c, continue_final_message, **template_kw) for c in convs]
        return convs, built

    @staticmethod
    def _response(out, capture: bool, cls=SteerResponse, **extra) -> SteerResponse:
        c = out.outputs[0]
        # results() raises a HookRuntimeError when an op or capture could not be applied
        res = results_of(out) if getattr(out, ATTR, None) is not None else None
        return cls(text=c.text, token_ids=list(c.token_ids), prompt_token_ids=list(out.prompt_token_ids),
                   results=res, raw=out, **extra)

    @staticmethod
    def _remote_chat(outs, convs, built, continue_final_message: bool) -> list:
        return [_remote(g, ChatResponse, message_boundaries=b,
                        prefill=str(c[-1].get("content", "")) if continue_final_message else "")
                for g, c, (_, b) in zip(outs, convs, built)]

    def _chat_responses(self, outs, convs, built, continue_final_message: bool, capture: bool):
        return [self._response(o, capture, ChatResponse, message_boundaries=b,
                               prefill=str(c[-1].get("content", "")) if continue_final_message else "")
                for o, c, (_, b) in zip(outs, convs, built)]


# SamplingParams fields a server takes by the same name (OpenAI or vLLM extensions).
HTTP_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "n")


def _http_sampling(sampling_params, sampling: dict) -> dict:
    """Sampling keywords for a server: `sampling` as given, or a SamplingParams' fields."""
    if sampling_params is None:
        return dict(sampling)
    if sampling:
        raise ValueError("pass sampling_params or sampling keywords, not both")
    return {k: getattr(sampling_params, k) for k in HTTP_FIELDS if getattr(sampling_params, k, None) is not None}


def _call_ops(steering_spec: Any) -> list:
    """A call's own steering ops: {"steer": [...]}, a list of ops, or an object with ops()."""
    if steering_spec is None:
        return []
    if hasattr(steering_spec, "ops"):
        return list(steering_spec.ops())
    if isinstance(steering_spec, dict):
        return list(steering_spec.get("steer") or [])
    return list(steering_spec)


def _remote(g: Any, cls=SteerResponse, **extra) -> SteerResponse:
    return cls(text=g.text, token_ids=list(g.token_ids or []), prompt_token_ids=list(g.prompt_token_ids or []),
               results=g.results, raw=g, **extra)


def _tokenizer(tok: Any) -> Any:
    if isinstance(tok, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tok))
    return tok


def _prompts(prompts, offline: bool = True) -> list:
    """A batch of prompts: text, token ids or vLLM prompt dicts (one of them, or a list)."""
    if isinstance(prompts, (str, dict)) or (prompts and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    out = list(prompts)
    return [{"prompt_token_ids": list(p)} if offline and not isinstance(p, (str, dict)) else p for p in out]


class SteerModel(_Session):
    """A steering session over `vllm.LLM` (see the module docstring)."""

    def __init__(self, llm: Any, *, tokenizer: Any = None):
        self.llm = llm
        if isinstance(llm, Client):
            h = llm.health()
            super().__init__(h["hidden_size"], h["num_layers"], _tokenizer(tokenizer))
        else:
            info = model_info(model_config_of(llm))
            super().__init__(info.hidden_size, info.num_layers, llm.get_tokenizer())

    def generate(self, prompts: str | Sequence[str], sampling_params=None, *, capture_layers=None,
                 raw_output: bool = False, steering_spec=None, **sampling) -> list:
        if isinstance(self.llm, Client):
            spec, kw = self._spec(capture_layers, steering_spec), _http_sampling(sampling_params, sampling)
            outs = [self.llm.generate(p, spec=spec or None, **kw) for p in _prompts(prompts, offline=False)]
            return outs if raw_output else [_remote(g) for g in outs]
        sp = self._params(sampling_params, sampling, capture_layers, steering_spec)
        outs = self.llm.generate(_prompts(prompts), sp, use_tqdm=False)
        return outs if raw_output else [self._response(o, bool(capture_layers)) for o in outs]

    def chat(self, conversations, sampling_params=None, *, capture_layers=None, continue_final_message=False,
             raw_output: bool = False, chat_template_kwargs: dict | None = None, steering_spec=None,
             **sampling) -> list:
        """`conversations`: one list of messages or several. Per conversation a ChatResponse."""
        convs, built = self._chat_inputs(conversations, continue_final_message, chat_template_kwargs or {})
        if isinstance(self.llm, Client):
            spec, kw = self._spec(capture_layers, steering_spec), _http_sampling(sampling_params, sampling)
            outs = [self.llm.generate(list(ids), spec=spec or None, **kw) for ids, _ in built]
            return outs if raw_output else self._remote_chat(outs, convs, built, continue_final_message)
        sp = self._params(sampling_params, sampling, capture_layers, steering_spec)
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids, _ in built], sp, use_tqdm=False)
        return outs if raw_output else self._chat_responses(outs, convs, built, continue_final_message,
                                                            bool(capture_layers))

    @contextlib.contextmanager
    def steering(self, spec):
        """`with model.steering(spec):` the state with `spec` on top; restored after."""
        self.push_steering_spec(spec)
        try:
            yield self
        finally:
            self.pop_steering_spec()


class AsyncSteerModel(_Session):
    """A steering session over `vllm.AsyncLLM` (for notebooks and services)."""

    def __init__(self, engine: Any, *, tokenizer: Any = None, dims: tuple[int, int] | None = None):
        """Over an `AsyncClient`, pass `dims=(hidden_size, num_layers)` (from `await
        client.health()`: a constructor cannot await) and a `tokenizer` for chat()."""
        self.engine = engine
        if isinstance(engine, AsyncClient):
            if dims is None:
                raise ValueError("AsyncSteerModel over an AsyncClient needs dims=(hidden_size, num_layers); "
                                 "h = await client.health(); dims=(h['hidden_size'], h['num_layers'])")
            super().__init__(dims[0], dims[1], _tokenizer(tokenizer))
        else:
            info = model_info(engine.model_config)
            super().__init__(info.hidden_size, info.num_layers, engine.get_tokenizer())

    async def _run(self, prompt, sp) -> Any:
        last = None
        async for out in self.engine.generate(prompt, sp, f"steer-{uuid.uuid4().hex}"):
            last = out
        return last

    async def generate(self, prompts, sampling_params=None, *, capture_layers=None, raw_output: bool = False,
                       steering_spec=None, **sampling) -> list:
        if isinstance(self.engine, AsyncClient):
            spec, kw = self._spec(capture_layers, steering_spec), _http_sampling(sampling_params, sampling)
            outs = await asyncio.gather(*(self.engine.generate(p, spec=spec or None, **kw)
                                          for p in _prompts(prompts, offline=False)))
            return list(outs) if raw_output else [_remote(g) for g in outs]
        sp = self._params(sampling_params, sampling, capture_layers, steering_spec)   # the snapshot: now
        outs = await asyncio.gather(*(self._run(p, sp.clone()) for p in _prompts(prompts)))
        return list(outs) if raw_output else [self._response(o, bool(capture_layers)) for o in outs]

    async def chat(self, conversations, sampling_params=None, *, capture_layers=None,
                   continue_final_message=False, raw_output: bool = False,
                   chat_template_kwargs: dict | None = None, steering_spec=None, **sampling) -> list:
        convs, built = self._chat_inputs(conversations, continue_final_message, chat_template_kwargs or {})
        if isinstance(self.engine, AsyncClient):
            spec, kw = self._spec(capture_layers, steering_spec), _http_sampling(sampling_params, sampling)
            outs = await asyncio.gather(*(self.engine.generate(list(ids), spec=spec or None, **kw) for ids, _ in built))
            return list(outs) if raw_output else self._remote_chat(list(outs), convs, built, continue_final_message)
        sp = self._params(sampling_params, sampling, capture_layers, steering_spec)
        outs = await asyncio.gather(*(self._run({"prompt_token_ids": ids}, sp.clone()) for ids, _ in built))
        return list(outs) if raw_output else self._chat_responses(list(outs), convs, built, continue_final_message,
                                                                  bool(capture_layers))

    @contextlib.asynccontextmanager
    async def steering(self, spec):
        """`async with model.steering(spec):` as the sync form. The state is the session's: an
        overlapping block in another task sees it too (requests never do: they snapshot)."""
        self.push_steering_spec(spec)
        try:
            yield self
        finally:
            self.pop_steering_spec()
