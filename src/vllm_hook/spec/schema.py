"""The request spec: one pydantic schema for offline (`SamplingParams.extra_args`) and HTTP
(`vllm_xargs`, as a JSON string). This module checks the *shape* of a spec; `resolve.py`
checks it against the model and the prompt and produces the compact wire form for workers.
"""

from __future__ import annotations

import json
import numbers
from functools import cached_property
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, field_validator

from ..config import SpecSite
from ..hooks.hook import Hook
from .errors import SpecError

SPEC_KEY = "vllm_hook"

# Bounds on what one spec may hold: resolving it runs in the API server's event loop.
MAX_CAPTURE_ITEMS = 1024
MAX_STEER_OPS = 1024
MAX_HOOKS = 64
MAX_LIST = 65536          # positions, layers or heads in one list
MAX_SPEC_ENTRIES = 65536  # ... and in all the spec's lists together (each is checked in Python)
MAX_SPEC_CHARS = 8 << 20   # a spec as JSON text (inline vectors included: base64 is 4x denser)


def _integer(v: Any) -> Any:
    """Integers only: pydantic's lax mode would take True as 1 and 4.0 as 4."""
    if type(v) is int:           # the common case, before the ABC checks (a 28-op spec: 56 of them)
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"expected an integer, got {type(v).__name__} {v!r}")
    return int(v)


def _number(v: Any) -> Any:
    """Real numbers only (no bools, no numeric strings)."""
    if type(v) is float:
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"expected a number, got {type(v).__name__} {v!r}")
    try:
        return float(v)
    except OverflowError:              # an integer beyond any float
        raise ValueError(f"{str(v)[:20]}... is too large for a number") from None


Int = Annotated[int, BeforeValidator(_integer)]
Float = Annotated[float, BeforeValidator(_number)]
IntList = Annotated[list[Int], Field(min_length=0, max_length=MAX_LIST)]
SelectorName = Literal["all", "prompt", "generated", "last_prompt", "last"]
Selector = Union[SelectorName, IntList]
Layers = Union[Literal["all"], IntList, Int]
Heads = Union[Literal["all"], IntList, dict[str, IntList]]


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
    layer: Int
    vector: Any = Field(description="list of floats, numpy/torch vector, base64 dict or a name")
    tokens: Selector = "all"


class AddOp(_SteerBase):
    """h <- h + scale*v, or with norm_match h <- h + scale*||h||*v/||v|| (per token)."""

    op: Literal["add"]
    scale: Float = 1.0
    norm_match: StrictBool = False      # "yes" or 1 would read as true


class CapOp(_SteerBase):
    """p = h.u (u = v/||v||); h <- h + (clamp(p, min, max) - p)*u."""

    op: Literal["cap"]
    min: Float | None = None
    max: Float | None = None


class AblateOp(_SteerBase):
    """p = h.u; h <- h + (scale - 1)*p*u (scale 0 removes the direction)."""

    op: Literal["ablate"]
    scale: Float = 0.0


SteerOp = Annotated[Union[AddOp, CapOp, AblateOp], Field(discriminator="op")]


class NamedHook(_Model):
    """An operator hook, by name, with JSON arguments (`hooks/registry.py`)."""

    name: str = Field(min_length=1, max_length=128)
    args: dict[str, Any] = Field(default_factory=dict)


class PickledHook(_Model):
    """base64(cloudpickle(vllm_hook.Hook)): a server runs it only with allow_client_code."""

    pickle: Union[str, bytes]


HookItem = Union[Hook, NamedHook, PickledHook]


class SaveSpec(_Model):
    """Also write the request's results as one safetensors file under `dir`."""

    dir: str


class HookSpec(_Model):
    capture: list[CaptureItem] = Field(default_factory=list, max_length=MAX_CAPTURE_ITEMS)
    steer: list[SteerOp] = Field(default_factory=list, max_length=MAX_STEER_OPS)
    hooks: list[HookItem] = Field(default_factory=list, max_length=MAX_HOOKS)
    save: SaveSpec | None = None
    # The dtype of the delivered tensors: float32, or the dtype the model computes in ("model":
    # no conversion, half the bytes of float32 for a bf16 model).
    dtype: Literal["float32", "model"] = "float32"

    @property
    def is_empty(self) -> bool:
        return not self.capture and not self.steer and not self.hooks

    @cached_property
    def positional(self) -> bool:
        """Whether it names token positions (a negative one counts from the prompt's end): only
        then does its resolution depend on the prompt's length beyond the wire's "P". Computed
        once: a cached spec is asked at every request (a walk over 28 ops, 2 to 3 µs)."""
        return any(isinstance(c.tokens, list) for c in self.capture) or any(
            isinstance(op.tokens, list) for op in self.steer)


_BRANCH_TAGS = {"add", "cap", "ablate", "int", "str", "float", "bool", "dict", "list", "Hook",
                "NamedHook", "PickledHook", "bytes"}


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


_FIELD_FIX = {
    "scale": "pass a finite number", "min": "pass a finite number or leave it out",
    "max": "pass a finite number or leave it out",
    "vector": ("pass a list of floats, a numpy array or torch tensor, "
               '{"b64": ..., "dtype": "float32"} or a registered name'),
    "save": 'pass {"dir": "/path/to/folder"} (offline only)',
    "norm_match": "pass true or false",
    "capture": "pass a list of capture items, e.g. [{\"layers\": [0], \"tokens\": \"last\"}]",
    "steer": "pass a list of steering ops, e.g. [{\"op\": \"add\", \"layer\": 0, \"vector\": ...}]",
}


def _pick(errors: list[dict]) -> dict:
    """The most telling of pydantic's errors: the branch of a union that got furthest (its
    first branch, such as "all" for layers, is rarely what the user meant), our own
    validators' messages first."""
    def telling(e: dict) -> tuple:
        literal = e["type"] == "literal_error"
        return (len(e["loc"]), literal == isinstance(e.get("input"), str), e["type"] == "value_error")
    return max(errors, key=telling)


def _first_error(err: ValidationError) -> SpecError:
    e = _pick(err.errors())
    where = _loc(e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    etype = e["type"]
    loc = [p for p in e["loc"] if isinstance(p, str) and p not in _BRANCH_TAGS and "[" not in p]
    field = loc[-1] if loc else ""
    if etype == "extra_forbidden":
        fix = "remove it; see docs/spec.md for the fields this schema accepts"
        msg = f"unknown field {e['loc'][-1]!r}"
    elif etype == "union_tag_invalid" or etype == "union_tag_not_found":
        fix = 'use "op": "add", "cap" or "ablate"'
    elif etype == "too_long":
        fix = "split the work over several requests"
    elif etype == "literal_error" and "site" in loc:
        fix = 'use one of "resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k", "attn_scores"'
    elif "tokens" in loc:
        fix = ('use "all", "prompt", "generated", "last_prompt", "last" or a list of '
               "integer token positions (negative counts from the end of the prompt)")
    elif loc == ["dtype"]:
        fix = 'use "float32" (the default) or "model" (the dtype the model computes in)'
    elif "heads" in loc:
        fix = 'use a list of integer head indices, "all", or {"<layer>": [heads]}'
    elif "layers" in loc or "layer" in loc:
        fix = 'use an integer layer index (negative counts from the last layer), a list of them, or "all"'
    elif "hooks" in loc:
        fix = ('pass vllm_hook.Hook objects (offline), {"name": ..., "args": {...}} for an '
               'operator hook, or {"pickle": <base64 cloudpickle of a Hook>}')
    elif field in _FIELD_FIX:
        fix = _FIELD_FIX[field]
    else:
        fix = f"see docs/spec.md for {field or 'the spec'}"
    return SpecError(where, msg, fix)


def _check_entries(raw: dict) -> None:
    """Refuse, before validating, a spec whose integer lists hold more than MAX_SPEC_ENTRIES
    entries in all: each entry is checked in Python, and 1,024 items of 65,536 positions
    would keep the API server's event loop busy for seconds. O(items)."""
    total = 0
    for key, fields in (("capture", ("layers", "tokens", "heads")), ("steer", ("tokens",))):
        items = raw.get(key)
        for item in items if isinstance(items, list) else ():
            for f in fields:
                v = item.get(f) if isinstance(item, dict) else None
                if isinstance(v, list):
                    total += len(v)
                elif isinstance(v, dict):
                    total += sum(len(x) if isinstance(x, list) else 1 for x in v.values())
    if total > MAX_SPEC_ENTRIES:
        raise SpecError("spec", f"its layer, token and head lists hold {total} entries, more than "
                        f"{MAX_SPEC_ENTRIES} in all", 'use selectors ("all", "prompt", "last_prompt", '
                        "...) and \"all\" layers instead of long lists, or split the work over requests")


def parse_spec(raw: Any) -> HookSpec:
    """Validate the shape of a spec given as a dict, a JSON string or a HookSpec."""
    if isinstance(raw, HookSpec):
        return raw
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode("utf-8", errors="replace")
    if isinstance(raw, str):
        if len(raw) > MAX_SPEC_CHARS:
            raise SpecError("spec", f"{len(raw)} characters is more than a spec may hold "
                            f"({MAX_SPEC_CHARS})", "register large vectors once "
                            "(register_vectors, POST /v1/hook/vectors) and name them, or send "
                            'them as {"b64": ...} (the clients do)')
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SpecError("spec", f"malformed JSON ({e.msg} at position {e.pos})",
                            "send the spec as a JSON object, e.g. json.dumps(spec)") from None
        except RecursionError:
            raise SpecError("spec", "JSON nested too deeply", "send a flat spec object") from None
    if not isinstance(raw, dict):
        raise SpecError("spec", f"expected an object, got {type(raw).__name__}",
                        'pass a dict such as {"capture": [...], "steer": [...]}')
    _check_entries(raw)
    try:
        return HookSpec.model_validate(raw)
    except ValidationError as err:
        raise _first_error(err) from None
    except RecursionError:
        raise SpecError("spec", "nested too deeply", "send a flat spec object") from None
