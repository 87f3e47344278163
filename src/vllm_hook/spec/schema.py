"""The request spec: one pydantic schema for offline (`SamplingParams.extra_args`) and HTTP
(`vllm_xargs`, as a JSON string). This module checks the *shape* of a spec; `resolve.py`
checks it against the model and the prompt and produces the compact wire form for workers.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..config import SpecSite
from .errors import SpecError

SPEC_KEY = "vllm_hook"

SelectorName = Literal["all", "prompt", "generated", "last_prompt", "last"]
Selector = Union[SelectorName, list[int]]
Layers = Union[Literal["all"], list[int], int]
Heads = Union[Literal["all"], list[int], dict[str, list[int]]]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class CaptureItem(_Model):
    """Copy the residual stream, a sublayer output or attention internals at `site` of
    `layers` for `tokens` (default "all"; for attn_scores: the query tokens, default
    "last_prompt"). `heads` selects attention heads for q, k and attn_scores."""

    layers: Layers = "all"
    site: SpecSite = "resid_post"
    tokens: Selector | None = None
    heads: Heads | None = None

    @field_validator("layers")
    @classmethod
    def _layers_list(cls, v):
        return [v] if isinstance(v, int) else v


class _SteerBase(_Model):
    layer: int
    vector: Any = Field(description="list of floats, numpy/torch vector, base64 dict or a name")
    tokens: Selector = "all"


class AddOp(_SteerBase):
    """h <- h + scale*v, or with norm_match h <- h + scale*||h||*v/||v|| (per token)."""

    op: Literal["add"]
    scale: float = 1.0
    norm_match: bool = False


class CapOp(_SteerBase):
    """p = h.u (u = v/||v||); h <- h + (clamp(p, min, max) - p)*u."""

    op: Literal["cap"]
    min: float | None = None
    max: float | None = None


class AblateOp(_SteerBase):
    """p = h.u; h <- h + (scale - 1)*p*u (scale 0 removes the direction)."""

    op: Literal["ablate"]
    scale: float = 0.0


SteerOp = Annotated[Union[AddOp, CapOp, AblateOp], Field(discriminator="op")]


class SaveSpec(_Model):
    """Also write the request's results as one safetensors file under `dir`."""

    dir: str


class HookSpec(_Model):
    capture: list[CaptureItem] = Field(default_factory=list)
    steer: list[SteerOp] = Field(default_factory=list)
    save: SaveSpec | None = None
    # The dtype of the delivered tensors: float32, or the dtype the model computes in ("model":
    # no conversion, half the bytes of float32 for a bf16 model).
    dtype: Literal["float32", "model"] = "float32"

    @property
    def is_empty(self) -> bool:
        return not self.capture and not self.steer


_BRANCH_TAGS = {"add", "cap", "ablate", "int", "str", "float", "bool", "dict", "list"}


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _BRANCH_TAGS:
            continue  # pydantic's union-branch names are noise for a user
        else:
            out += f".{part}" if out else str(part)
    return out or "spec"


def _first_error(err: ValidationError) -> SpecError:
    e = min(err.errors(), key=lambda x: len(x["loc"]))
    where = _loc(e["loc"])
    msg = e["msg"]
    etype = e["type"]
    if etype == "extra_forbidden":
        fix = "remove it; see docs/spec.md for the fields this schema accepts"
        msg = f"unknown field {e['loc'][-1]!r}"
    elif etype == "union_tag_invalid" or etype == "union_tag_not_found":
        fix = 'use "op": "add", "cap" or "ablate"'
    elif etype == "literal_error" and "site" in str(e["loc"]):
        fix = 'use one of "resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k", "attn_scores"'
    elif "tokens" in str(e["loc"]):
        fix = ('use "all", "prompt", "generated", "last_prompt", "last" or a list of '
               "token positions (negative counts from the end of the prompt)")
    elif e["loc"] == ("dtype",):
        fix = 'use "float32" (the default) or "model" (the dtype the model computes in)'
    elif "heads" in str(e["loc"]):
        fix = 'use a list of head indices, "all", or {"<layer>": [heads]}'
    elif "layers" in str(e["loc"]) or "layer" in str(e["loc"]):
        fix = 'use a layer index (negative counts from the last layer), a list, or "all"'
    else:
        fix = "see docs/spec.md"
    return SpecError(where, msg, fix)


def parse_spec(raw: Any) -> HookSpec:
    """Validate the shape of a spec given as a dict, a JSON string or a HookSpec."""
    if isinstance(raw, HookSpec):
        return raw
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode("utf-8", errors="replace")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SpecError("spec", f"malformed JSON ({e.msg} at position {e.pos})",
                            "send the spec as a JSON object, e.g. json.dumps(spec)") from None
    if not isinstance(raw, dict):
        raise SpecError("spec", f"expected an object, got {type(raw).__name__}",
                        'pass a dict such as {"capture": [...], "steer": [...]}')
    try:
        return HookSpec.model_validate(raw)
    except ValidationError as err:
        raise _first_error(err) from None
