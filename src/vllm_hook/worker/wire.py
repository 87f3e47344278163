"""The worker's own check of a spec's wire form before it is admitted.

The frontend resolves every spec (`spec.resolve`), so this should never fail; it is the
worker's guarantee that values reaching the per-step path (positions, layers, selectors,
coefficients) are of the types and ranges that path assumes, so that no request can make
a step fail for the others in its batch. A failure fails that request only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..model.layout import PointTable
from ..spec.resolve import STEER_COLUMNS

SELECTORS = ("all", "prompt", "generated", "last_prompt", "last", "pos")
MAX_POSITION = 1 << 40          # far beyond any max_model_len; far inside int64


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
        raise ValueError(f"{what} {v!r} is not an integer in [{lo}, {hi})")
    return v


def _selector(item: dict, what: str) -> None:
    if item.get("sel") not in SELECTORS:
        raise ValueError(f"{what}: unknown selector {item.get('sel')!r}")
    pos = item.get("pos", ())
    if not isinstance(pos, (list, tuple)):
        raise ValueError(f"{what}: positions are not a list")
    for p in pos:
        _int(p, 0, MAX_POSITION, f"{what} position")


def check_wire(wire: dict, num_layers: int, hidden: int, points: PointTable, steer_ops: bool = True,
               caps: bool = True) -> np.ndarray | None:
    """Raise ValueError naming the first value the per-step path could not take; return the
    steering coefficients, (ops, 5), if checked. Vectorised over the steering ops: a spec
    steering every layer is checked in a few numpy calls. `steer_ops=False` (`caps=False`):
    the request takes the checked routes of another that steers (captures) alike (its own are
    never read), so they are not checked again."""
    _int(wire.get("P"), 1, MAX_POSITION, "prompt length")
    if "M" in wire:
        _int(wire["M"], 1, MAX_POSITION, "max_tokens")
    if "W" in wire:
        _int(wire["W"], 0, 2, "the float32 flag")
    for i, c in enumerate(wire.get("cap", ()) if caps else ()):
        what = f"capture {i}"
        L = _int(c.get("layer"), 0, num_layers, f"{what} layer")
        if not points.has(c.get("site"), L):
            raise ValueError(f"{what}: site {c.get('site')!r} is not instrumented at layer {L}")
        _selector(c, what)
    steer = wire.get("steer") if steer_ops else None
    if not steer:
        return None
    # Columns (`spec.resolve.unpack_steer`): one array per field, not a loop over the ops
    try:
        n = len(steer["layer"])
        if any(len(steer[k]) != n for k in STEER_COLUMNS if k != "c"):
            raise ValueError("columns of different lengths")
        layers = np.asarray(steer["layer"])
        coef = steer["c"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"steering ops are malformed ({e})") from None
    if n == 0 or layers.dtype.kind not in "iu" or layers.min() < 0 or layers.max() >= num_layers:
        raise ValueError(f"steering layers {layers.tolist()} are not integers in [0, {num_layers})")
    coef = check_coefficients(coef, n)
    sels, poss, names, vecs = steer["sel"], steer["pos"], steer["name"], steer["vec"]
    # Whole columns first (C loops); op by op only where they do not pass
    if set(sels) != {"all"} or poss.count([]) != n:
        for i, (sel, pos) in enumerate(zip(sels, poss)):
            if sel != "all" or pos or not isinstance(pos, (list, tuple)):
                _selector({"sel": sel, "pos": pos}, f"steering op {i}")
    if set(map(type, steer["digest"])) != {str}:
        raise ValueError("steering ops without a vector digest")
    if vecs.count(None) != n or set(map(type, names)) != {str}:
        for i, (name, vec) in enumerate(zip(names, vecs)):
            check_source(i, name, vec, hidden)
    return coef


def check_source(i: int, name: Any, vec: Any, hidden: int) -> None:
    """Op `i`'s vector: `hidden` float32 values (bytes), or else a registered name."""
    if vec is None:
        if not isinstance(name, str):
            raise ValueError(f"steering op {i}: neither a vector nor a registered name")
    elif not isinstance(vec, (bytes, bytearray)) or len(vec) != 4 * hidden:
        got = len(vec) if isinstance(vec, (bytes, bytearray)) else repr(vec)
        raise ValueError(f"steering op {i}: vector of {got} bytes, expected {4 * hidden}")


def check_coefficients(c, n: int) -> np.ndarray:
    """The (n, 5) coefficients of `n` steering ops from a wire's flat "c" column (float64
    bytes, `spec.resolve.coef_bytes`, or a list), or ValueError: 5 numbers each, none NaN,
    the first 3 finite."""
    try:
        if isinstance(c, (bytes, bytearray)):
            coef = np.frombuffer(c, dtype=np.float64)
        else:
            coef = np.asarray(c, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"steering ops are malformed ({e})") from None
    if coef.shape != (5 * n,):
        raise ValueError("steering coefficients are not 5 numbers each, the first 3 finite")
    coef = coef.reshape(n, 5)
    # Two reductions, not four ufuncs: a sum is finite only if its terms are (a sum too large
    # for float64 is refused too: the frontend's bounds are far below it); a max is NaN if a
    # term is
    if not math.isfinite(float(coef[:, :3].sum())) or math.isnan(float(coef[:, 3:].max())):
        raise ValueError("steering coefficients are not 5 numbers each, the first 3 finite")
    return coef
