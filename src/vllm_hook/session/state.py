"""Steering state of a session (pure: no engine): ops per layer, a push/pop stack, and the
request spec they make. A request takes a snapshot when it is submitted, so a change applies
to requests submitted after it and never to those in flight."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..spec.errors import SpecError
from ..spec.vectors import encode_vector

KINDS = ("add", "cap", "ablate")      # at one layer, applied in this order


def _vec(v: Any, hidden: int | None, where: str) -> np.ndarray:
    arr = np.asarray(v.detach().float().cpu().numpy() if hasattr(v, "detach") else v, dtype=np.float32)
    if arr.ndim != 1 or (hidden is not None and arr.shape[0] != hidden):
        raise SpecError(where, f"expected a vector of {hidden} values, got shape {tuple(arr.shape)}",
                        f"pass a 1-D vector of the model's hidden size ({hidden})")
    if not np.isfinite(arr).all():
        raise SpecError(where, "vector has NaN or infinite values", "pass finite values")
    return arr


class SteeringState:
    def __init__(self, hidden_size: int | None = None, num_layers: int | None = None):
        self.hidden, self.num_layers = hidden_size, num_layers
        self._ops: dict[int, dict[str, dict]] = {}
        self._stack: list[dict[int, dict[str, dict]]] = []

    # -- per layer
    def _layer(self, layer: int) -> int:
        if self.num_layers is not None and not -self.num_layers <= layer < self.num_layers:
            raise SpecError("layer", f"layer {layer} is out of range for {self.num_layers} layers",
                            f"use 0..{self.num_layers - 1} (or negative from the end)")
        return layer % self.num_layers if self.num_layers else layer

    def _set(self, layer: int, kind: str, op: dict) -> None:
        L = self._layer(layer)
        op["vector"] = _vec(op["vector"], self.hidden, f"layer {L} {kind}.vector")
        self._ops.setdefault(L, {})[kind] = {"op": kind, "layer": L, **{k: v for k, v in op.items() if v is not None}}

    def set_vector(self, layer: int, vector, scale: float = 1.0, norm_match: bool = False, tokens="all") -> None:
        self._set(layer, "add", {"vector": vector, "scale": float(scale), "norm_match": bool(norm_match),
                                 "tokens": tokens})

    def set_cap(self, layer: int, vector, min: float | None = None, max: float | None = None, tokens="all") -> None:
        if min is None and max is None:
            raise SpecError(f"layer {layer} cap", "a projection cap needs min, max or both", "pass min= and/or max=")
        self._set(layer, "cap", {"vector": vector, "min": min, "max": max, "tokens": tokens})

    def set_ablation(self, layer: int, vector, scale: float = 0.0, tokens="all") -> None:
        self._set(layer, "ablate", {"vector": vector, "scale": float(scale), "tokens": tokens})

    def clear(self, layer: int | None = None, kind: str | None = None) -> None:
        layers = list(self._ops) if layer is None else [self._layer(layer)]
        for L in layers:
            if kind is None:
                self._ops.pop(L, None)
            else:
                self._ops.get(L, {}).pop(kind, None)
                if not self._ops.get(L):
                    self._ops.pop(L, None)

    # -- specs
    def export(self) -> dict:
        """The state as our spec's `steer` list (vectors as float32 lists: exact, JSON-safe)."""
        return {"steer": [{**op, "vector": op["vector"].tolist()} for _, op in self._items()]}

    def steer_ops(self) -> list[dict]:
        """What a request carries: the ops, vectors as exact base64."""
        return [{**op, "vector": encode_vector(op["vector"])} for _, op in self._items()]

    def _items(self):
        for L in sorted(self._ops):
            for kind in KINDS:
                if kind in self._ops[L]:
                    yield L, self._ops[L][kind]

    def apply(self, spec: Any, replace: bool = True) -> None:
        """Set the state from a spec (`export()`'s form, or our spec's `steer` list): every op
        replaces the layer's op of its kind; `replace` clears the rest first."""
        ops = spec.get("steer", []) if isinstance(spec, dict) else list(spec or [])
        new = SteeringState(self.hidden, self.num_layers)
        if not replace:
            new._ops = copy.deepcopy(self._ops)
        for i, op in enumerate(ops):
            if not isinstance(op, dict) or op.get("op") not in KINDS or "layer" not in op or "vector" not in op:
                raise SpecError(f"steer[{i}]", f"expected an op with op in {KINDS}, layer and vector",
                                "see docs/spec.md")
            rest = {k: v for k, v in op.items() if k not in ("op", "layer")}
            try:
                {"add": new.set_vector, "cap": new.set_cap, "ablate": new.set_ablation}[op["op"]](op["layer"], **rest)
            except TypeError as e:
                raise SpecError(f"steer[{i}]", f"unknown field ({e})", "see docs/spec.md") from None
        self._ops = new._ops

    def push(self, spec: Any = None) -> None:
        """Save the state; then apply `spec` on top of it (its ops replace those of their layer
        and kind, the others stay)."""
        self._stack.append(copy.deepcopy(self._ops))
        if spec is not None:
            try:
                self.apply(spec, replace=False)
            except Exception:
                self._ops = self._stack.pop()
                raise

    def pop(self) -> None:
        if not self._stack:
            raise IndexError("pop_steering_spec without a matching push_steering_spec")
        self._ops = self._stack.pop()

    @property
    def layers(self) -> list[int]:
        return sorted(self._ops)
