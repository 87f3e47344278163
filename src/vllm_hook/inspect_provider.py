"""Inspect AI model provider `vllm-hook/<model>`: a `vllm serve` with this plugin, per-request
specs through `GenerateConfig.extra_body`, results in `ModelOutput.metadata`.

    from inspect_ai import eval
    from vllm_hook.inspect_provider import extra_body
    eval(task, model="vllm-hook/Qwen/Qwen2-1.5B-Instruct", model_base_url="http://host:8000/v1",
         model_args={"api_key": "..."},
         extra_body=extra_body({"capture": [{"layers": [8, 16], "tokens": "last_prompt"}]}))

`extra_body["vllm_hook"]` is our spec: a JSON-able dict, or the JSON string `extra_body(spec)`
makes of any spec (Inspect writes its config to the log as JSON, so tensor and numpy vectors
must be serialised before they go in: exact base64 float32);
vllm-lens-style `extra_body["extra_args"]` (`output_residual_stream`, `apply_steering_vectors`)
works too; `extra_body["lora_request"] = {"lora_name": ...}` asks the server for that adapter.
Each output's metadata gets `activations` ({site: {layer: tensor}}, rows as in `Results`),
`positions`, `hook_results` and `vllm_hook_errors`; tensors stay in memory (Inspect's log
files store them as null). Registered through the `inspect_ai` entry point group; the rest
(the server connection, retries, LoRA names) is Inspect's own vLLM provider.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from typing import Any

from inspect_ai.model import GenerateConfig, ModelOutput, modelapi
from inspect_ai.model._providers.vllm import VLLMAPI

from .client import AsyncClient, hook_field, spec_json
from .spec.lens import SteeringVector
from .spec.schema import SPEC_KEY

# The response of this task's request: Inspect hands it to on_response() inside generate().
_response: ContextVar[dict | None] = ContextVar("vllm_hook_response", default=None)


@modelapi(name="vllm-hook")
class VLLMHookAPI(VLLMAPI):
    """Inspect's vLLM provider, with vllm-hook's spec in and results out."""

    def on_response(self, response: dict[str, Any]) -> None:
        _response.set(response)

    async def generate(self, input, tools, tool_choice, config: GenerateConfig):
        config = wire_config(config)
        token = _response.set(None)
        try:
            result = await super().generate(input, tools, tool_choice, config)
            response = _response.get()
            if response is None or hook_field(response) is None:
                return result
            output = result[0] if isinstance(result, tuple) else result
            if isinstance(output, ModelOutput):
                output.metadata = {**(output.metadata or {}), **await self._metadata(response)}
            if isinstance(result, tuple) and isinstance(getattr(result[1], "response", None), dict):
                result[1].response.pop("vllm_hook", None)    # the log keeps the text, not the tensors
            return result
        finally:
            _response.reset(token)

    async def _metadata(self, response: dict) -> dict:
        base = str(self.base_url or self._init_base_url or "")
        async with AsyncClient(base, api_key=self.api_key) as client:
            found = await client.results_of(response)
        if not found:
            return {}
        r = found[0]                      # Inspect asks for one choice
        return {"activations": {s: dict(v) for s, v in r.activations.items()},
                "positions": {s: dict(v) for s, v in r.positions.items()},
                "hook_results": r.hook_results, "vllm_hook_errors": list(r.errors)}


def extra_body(spec: Any = None, **more: Any) -> dict:
    """`GenerateConfig.extra_body` carrying `spec` (tensors serialised), plus `more` keys."""
    return {**more, **({SPEC_KEY: spec_json(spec)} if spec is not None else {})}


def wire_config(config: GenerateConfig) -> GenerateConfig:
    """`extra_body` as the server reads it: our spec and vllm-lens's arguments as
    `vllm_xargs` strings, `lora_request` as the model name, token ids always returned."""
    extra = dict(config.extra_body or {})
    xargs = dict(extra.pop("vllm_xargs", None) or {})
    if SPEC_KEY in extra:
        xargs[SPEC_KEY] = spec_json(extra.pop(SPEC_KEY))
    for k, v in (extra.pop("extra_args", None) or {}).items():
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, SteeringVector) for x in v):
            v = [x.to_json() for x in v]
        xargs[k] = v if isinstance(v, str) else json.dumps(v)
    lora = extra.pop("lora_request", None)
    if lora is not None:
        extra["model"] = lora["lora_name"] if isinstance(lora, dict) else getattr(lora, "lora_name")
    if xargs:
        extra["vllm_xargs"] = xargs
    extra.setdefault("return_token_ids", True)
    return config.model_copy(update={"extra_body": extra})
