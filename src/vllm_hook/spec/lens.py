"""vllm-lens-style request arguments, translated into our spec.

`extra_args={"output_residual_stream": [15, 20]}` captures the residual stream after those
layers at every token; `{"apply_steering_vectors": [SteeringVector(...)]}` adds vectors:
2-D activations `(n_layers, hidden)` one vector per layer (at `position_indices`, or every
token), 3-D `(n_layers, n_positions, hidden)` one vector per layer and position (positions
`position_indices`, or 0..n_positions-1). Both combine with a `"vllm_hook"` spec in the same
extra_args. Over HTTP they go in `vllm_xargs` (steering vectors as JSON, `SteeringVector.to_json`).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from .errors import SpecError
from .schema import SPEC_KEY
from .vectors import encode_vector

RESIDUAL = "output_residual_stream"
STEER = "apply_steering_vectors"
LENS_KEYS = (RESIDUAL, STEER)


def _array(v: Any) -> np.ndarray:
    if isinstance(v, dict) and "b64" in v:
        raw = base64.b64decode(v["b64"], validate=True)
        return np.frombuffer(raw, dtype=np.float32).reshape(v["shape"]).copy()
    if hasattr(v, "detach") and hasattr(v, "cpu"):      # torch.Tensor, without importing torch
        v = v.detach().float().cpu().numpy()
    return np.asarray(v, dtype=np.float32)


class SteeringVector(BaseModel):
    """Vectors added to the residual stream after `layer_indices` (vllm-lens names).

    `activations`: `(n_layers, hidden)`, or `(n_layers, n_positions, hidden)` for a vector per
    position; a torch tensor, numpy array or nested list. `scale` multiplies it; `norm_match`
    scales each token's update to that token's residual norm (`scale * ||h|| * v/||v||`; needs
    projection layers). `position_indices`: the absolute token positions (2-D: where the
    vectors apply, default every token; 3-D: one per position, default 0..n_positions-1)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    activations: Any
    layer_indices: list[int]
    scale: float = 1.0
    norm_match: bool = False
    position_indices: list[int] | None = None

    @field_validator("activations", mode="before")
    @classmethod
    def _to_array(cls, v: Any) -> np.ndarray:
        try:
            arr = _array(v)
        except Exception as e:
            raise ValueError(f"activations must be a tensor, array or nested list of floats ({e})") from None
        if arr.ndim not in (2, 3):
            raise ValueError(f"activations must be 2-D (n_layers, hidden) or 3-D (n_layers, n_positions, "
                             f"hidden), got shape {tuple(arr.shape)}")
        return arr

    @model_validator(mode="after")
    def _check(self) -> "SteeringVector":
        a = self.activations
        if a.shape[0] != len(self.layer_indices):
            raise ValueError(f"activations has {a.shape[0]} layers (dim 0) but layer_indices names "
                             f"{len(self.layer_indices)}")
        if a.ndim == 3 and self.position_indices is not None and len(self.position_indices) != a.shape[1]:
            raise ValueError(f"3-D activations have {a.shape[1]} positions (dim 1) but position_indices "
                             f"names {len(self.position_indices)}")
        return self

    def ops(self) -> list[dict]:
        """The steering ops of our spec that do the same (vectors as exact base64: JSON-safe)."""
        a, base = self.activations, {"op": "add", "scale": self.scale, "norm_match": self.norm_match}
        out = []
        for i, L in enumerate(self.layer_indices):
            if a.ndim == 2:
                tokens = list(self.position_indices) if self.position_indices is not None else "all"
                out.append({**base, "layer": L, "vector": encode_vector(a[i]), "tokens": tokens})
                continue
            positions = self.position_indices if self.position_indices is not None else range(a.shape[1])
            out.extend({**base, "layer": L, "vector": encode_vector(a[i, j]), "tokens": [int(p)]}
                       for j, p in enumerate(positions))
        return out

    def to_json(self) -> dict:
        """A JSON-safe dict (activations as exact base64 float32) for HTTP."""
        a = np.ascontiguousarray(self.activations, dtype=np.float32)
        return {"activations": {"b64": base64.b64encode(a.tobytes()).decode("ascii"), "shape": list(a.shape)},
                "layer_indices": list(self.layer_indices), "scale": self.scale,
                "norm_match": self.norm_match, "position_indices": self.position_indices}


def _loads(v: Any, where: str) -> Any:
    if isinstance(v, (str, bytes)):
        try:
            return json.loads(v)
        except (ValueError, RecursionError) as e:
            raise SpecError(where, f"not valid JSON ({e})", "send a JSON list") from None
    return v


def _steering_vectors(raw: Any) -> list[SteeringVector]:
    raw = _loads(raw, STEER)
    if not isinstance(raw, (list, tuple)):
        raise SpecError(STEER, f"expected a list of SteeringVector, got {type(raw).__name__}",
                        "pass [vllm_hook.SteeringVector(...), ...]")
    out = []
    for i, sv in enumerate(raw):
        if isinstance(sv, SteeringVector):
            out.append(sv)
            continue
        try:
            out.append(SteeringVector.model_validate(sv))
        except Exception as e:
            msg = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
            raise SpecError(f"{STEER}[{i}]", msg, "see vllm_hook.SteeringVector") from None
    return out


def translate(extra: dict) -> tuple[dict, list[int] | None]:
    """extra_args with the vllm-lens keys folded into our spec (the keys removed), and the
    layers of `output_residual_stream` (for the stacked view), or None."""
    rest = {k: v for k, v in extra.items() if k not in LENS_KEYS and k != SPEC_KEY}
    spec = _loads(extra.get(SPEC_KEY) or {}, SPEC_KEY)
    if isinstance(spec, BaseModel):      # a HookSpec
        spec = spec.model_dump(exclude_unset=True)
    if not isinstance(spec, dict):
        raise SpecError("spec", "expected a JSON object", "see docs/spec.md")
    spec = {**spec, "capture": list(spec.get("capture") or []), "steer": list(spec.get("steer") or [])}
    layers = None
    if RESIDUAL in extra:
        layers = _loads(extra[RESIDUAL], RESIDUAL)
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if not isinstance(layers, list) or not layers:
            raise SpecError(RESIDUAL, f"expected a non-empty list of layer indices, got {layers!r}",
                            "pass e.g. [15, 20]")
        spec["capture"].append({"site": "resid_post", "layers": layers, "tokens": "all"})
    if STEER in extra:
        for sv in _steering_vectors(extra[STEER]):
            spec["steer"].extend(sv.ops())
    return {**rest, SPEC_KEY: spec}, layers


def has_lens_args(extra: Any) -> bool:
    # (asked of every request, served ones three times: no generator)
    return isinstance(extra, dict) and not extra.keys().isdisjoint(LENS_KEYS)
