"""The worker's own check of a spec's wire form before it is admitted.

The frontend resolves every spec (`spec.resolve`), so this should never fail; it is the
worker's guarantee that values reaching the per-step path (positions, layers, selectors,
coefficients) are of the types and ranges that path assumes, so that no request can make
a step fail for the others in its batch. A failure fails that request only.
"""

from __future__ import annotations

import math
from typing import Any

from ..model.layout import PointTable

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


def check_wire(wire: dict, num_layers: int, hidden: int, points: PointTable) -> None:
    """Raise ValueError naming the first value the per-step path could not take."""
    _int(wire.get("P"), 1, MAX_POSITION, "prompt length")
    for i, c in enumerate(wire.get("cap", ())):
        what = f"capture {i}"
        L = _int(c.get("layer"), 0, num_layers, f"{what} layer")
        if not points.has(c.get("site"), L):
            raise ValueError(f"{what}: site {c.get('site')!r} is not instrumented at layer {L}")
        _selector(c, what)
    for i, op in enumerate(wire.get("steer", ())):
        what = f"steering op {i}"
        _int(op.get("layer"), 0, num_layers, f"{what} layer")
        _selector(op, what)
        coef = op.get("c")
        if (not isinstance(coef, (list, tuple)) or len(coef) != 5
                or not all(isinstance(x, (int, float)) and not math.isnan(x) for x in coef)
                or not all(math.isfinite(x) for x in coef[:3])):
            raise ValueError(f"{what}: coefficients {coef!r} are not 5 numbers (3 finite)")
        if "vec" in op and len(op["vec"]) != 4 * hidden:
            raise ValueError(f"{what}: vector of {len(op['vec'])} bytes, expected {4 * hidden}")
