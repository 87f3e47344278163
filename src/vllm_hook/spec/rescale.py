"""Specs equal but for their steering numbers: one parse and one resolve per shape.

A strength sweep, or a server whose clients each steer at a scale of their own, sends specs
that differ only in the `scale`, `min` and `max` of their steering ops. Each is new to the
frontend's cache (`frontend.cache`): parsing (pydantic) and resolving a 28-op spec cost about
110 µs a request on the CI machine. Here a raw spec splits into its shape (everything but those
numbers) and its numbers (`split`); a spec of a shape seen before is parsed and resolved in
full and kept as a `Template`; a later one only has its numbers checked and its coefficients,
digest and steering blob computed as `resolve` computes them (`rescaled`). This path never
decides an error: a number it does not pass (of another type, out of bounds, NaN) sends the
spec the full way, which names the error.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from .resolve import (STEER_COLUMNS, ModelInfo, Resolved, coef_bytes, digest_of, pack_steer,
                      shape_bytes, steer_bound, unpack_steer)
from .schema import MAX_SPEC_CHARS, AblateOp, AddOp, HookSpec

ADD, ADD_NORM, CAP, ABLATE = range(4)
_INF = math.inf


def split(raw: Any) -> tuple[dict, list[tuple]] | None:
    """(`raw` with its steering ops' numbers taken out, the numbers: (scale, min, max) of each
    op, None where absent), or None for a spec this path does not take (no steering, hooks,
    a number of another type, not plain JSON values). Each op's shape keeps its field names,
    so a field present or absent is part of it."""
    if isinstance(raw, str):
        if len(raw) > MAX_SPEC_CHARS or '"steer"' not in raw:
            return None
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    if type(raw) is not dict or raw.get("hooks"):
        return None
    steer = raw.get("steer")
    if type(steer) is not list or not steer:
        return None
    ops, nums = [], []
    get = dict.get
    for op in steer:
        if type(op) is not dict:
            return None
        s, lo, hi = get(op, "scale"), get(op, "min"), get(op, "max")
        # (checked one by one, not in a loop over the three: a fifth of the split's time)
        if s is None:
            if "scale" in op:                # never valid: the full way says so
                return None
        elif type(s) is not float and type(s) is not int:
            return None
        if lo is not None and type(lo) is not float and type(lo) is not int:
            return None
        if hi is not None and type(hi) is not float and type(hi) is not int:
            return None
        ops.append((tuple(op), get(op, "op"), get(op, "layer"), get(op, "vector"), get(op, "tokens"),
                    get(op, "norm_match")))
        nums.append((s, lo, hi))
    return {**raw, "steer": ops}, nums


@dataclass(frozen=True)
class Template:
    """What a spec of this shape resolves to but for its coefficients."""

    res: Resolved                      # what it was made from (kept by the cache, never a request's)
    kinds: tuple[int, ...]             # ADD, ADD_NORM, CAP or ABLATE per op
    bound: float                       # `steer_bound`
    cols: dict                         # the wire's steering columns, "c" aside
    shape: bytes                       # their `shape_bytes`
    positional: bool                   # the spec names token positions (`HookSpec.positional`)


def template(spec: HookSpec, res: Resolved, model: ModelInfo, max_ops_per_layer: int) -> Template:
    """`spec`, resolved as `res`, as the template of its shape."""
    kinds = tuple(ADD_NORM if isinstance(op, AddOp) and op.norm_match else ADD if isinstance(op, AddOp)
                  else ABLATE if isinstance(op, AblateOp) else CAP for op in spec.steer)
    cols = {k: v for k, v in unpack_steer(res.wire["steer"]).items() if k != "c"}
    return Template(res, kinds, steer_bound(model, max_ops_per_layer), cols, shape_bytes(cols), spec.positional)


def rescaled(t: Template, nums: list[tuple], prompt_len: int) -> Resolved | None:
    """A request's Resolved: the template's, with coefficients of `nums` (`split`) and a key
    of its own; None where `resolve` could refuse them (then the full way decides)."""
    bound, c = t.bound, []
    try:
        for kind, norm, (s, lo, hi) in zip(t.kinds, t.res.steer_norms, nums):
            # As `resolve` computes them
            if kind == ADD:
                s = 1.0 if s is None else float(s)
                if not (abs(s) <= bound and abs(s) * norm <= bound):    # NaN fails it too
                    return None
                c += (s, 0.0, 0.0, -_INF, _INF)
            elif kind == ADD_NORM:
                s = 1.0 if s is None else float(s)
                if not abs(s) <= bound:
                    return None
                c += (0.0, s, 0.0, -_INF, _INF)
            elif kind == ABLATE:
                s = 0.0 if s is None else float(s)
                if not abs(s - 1.0 + 1.0) <= bound:
                    return None
                c += (0.0, 0.0, s - 1.0, -_INF, _INF)
            else:
                lo = -_INF if lo is None else float(lo)
                hi = _INF if hi is None else float(hi)
                if (lo == -_INF and hi == _INF) or not lo <= hi or not (
                        (lo == -_INF or abs(lo) <= bound) and (hi == _INF or abs(hi) <= bound)):
                    return None
                c += (0.0, 0.0, 0.0, lo, hi)
    except OverflowError:          # an integer too large for a float
        return None
    c = coef_bytes(c)
    cols = {k: c if k == "c" else t.cols[k] for k in STEER_COLUMNS}
    res = t.res
    out = object.__new__(Resolved)
    key = os.urandom(16).hex()
    digest = digest_of(t.shape, c)
    out.__dict__ = {**res.__dict__, "key": key, "steer_digest": digest,
                    "wire": {**res.wire, "key": key, "steer": pack_steer(cols), "sd": digest}}
    if prompt_len != res.prompt_len:
        out.prompt_len = out.wire["P"] = prompt_len
        out.reads_cached_prefix = prompt_len >= res.prefix_from
    return out
