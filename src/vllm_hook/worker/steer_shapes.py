"""A worker's admission of a new steering spec, split by what its coefficients change.

A spec whose steering the worker has not seen costs its 28 ops' admission: op slots, vector
rows, products of unit vectors, columns and groups, then a parameter row each. Specs that steer
alike but for their coefficients (a strength sweep, clients each at a scale of their own:
`spec.rescale`) share everything but the parameter rows: kept here per steering shape (the
wire's "ss": a digest of the layers, selectors, positions and vector digests). The columns a
shape was made from are the ones used for every request of it; of a later wire, only its
coefficients and, for a vector not in the tables, the vector it carries (or names) are read.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np

from ..model.buffers import BufferShape, op_col
from ..routing import op_slots, reach, steer_group_index

MAX_SHAPES = 256              # kept at once


@dataclass(eq=False)
class SteerShape:
    n: int                               # ops
    layers: list[int]                    # the columns it was made from, as the wire gives
    digests: list[str]                   # them: a wire naming this shape must repeat them
    distinct: list[str]                  # each distinct vector's digest, in first use order
    refs: list[int]                      # ... the ops using it
    firsts: list[int]                    # ... its first op (whose "vec" or "name" gives it)
    vidx: np.ndarray                     # per op: its vector's index in `distinct`
    cols: list[int]                      # per op: op_idx column (`model.buffers.op_col`)
    sels: list[str]
    poss: list[tuple[int, ...]]
    earlier: list[tuple[int, list]]      # per op: (k, j) pairs, the op j each lower slot k holds
    groups: list[tuple]                  # `routing.steer_group_index`
    prods: np.ndarray | None = None      # (n, K - 1) products of unit vectors, made at first use
    reach: tuple = field(init=False)     # what its selectors may select (`routing.reach`),
                                         # told to each request's groups

    def __post_init__(self):
        self.reach = reach(self.groups, True)

    def products(self, K: int, unit: Callable[[int], np.ndarray], rows: list[int]) -> np.ndarray:
        """The G columns of the parameter rows (`model.steering`): unit vectors' products
        where an op shares its rows with ops of lower slots (none, for most specs), the rows
        of the distinct vectors being `rows` (the vectors' values do not change with them)."""
        if self.prods is None:
            prods = np.zeros((self.n, max(K - 1, 0)))
            for i, pairs in self.earlier:
                u = unit(rows[self.vidx[i]]).astype(np.float64)
                for k, j in pairs:
                    prods[i, k] = float(np.dot(u, unit(rows[self.vidx[j]])))
            self.prods = prods
        return self.prods


def shape_of(ops: dict[str, list], shape: BufferShape) -> SteerShape:
    """A spec's steering shape, from its columns (`spec.resolve.unpack_steer`, checked by
    `worker.wire.check_wire`)."""
    layers = [int(L) for L in ops["layer"]]
    n = len(layers)
    slots, earlier = [0] * n, []
    if len(set(layers)) != n:            # most specs have one op per layer: no slots to find
        by_layer: dict[int, list[int]] = {}
        for i, L in enumerate(layers):
            by_layer.setdefault(L, []).append(i)
        for idx in by_layer.values():
            if len(idx) == 1:
                continue
            got, prev, _ = op_slots([(ops["sel"][i], ops["pos"][i]) for i in idx])
            for i, s, p in zip(idx, got, prev):
                slots[i] = s
                # G with the op each lower slot holds on this op's rows (none: 0; several:
                # refused at admission when it matters, see spec.resolve._check_slots)
                pairs = [(k, idx[j]) for k, j in enumerate(p) if j is not None and j >= 0]
                if pairs:
                    earlier.append((i, pairs))
    index: dict[str, int] = {}
    distinct, refs, firsts = [], [], []
    vidx = np.empty(n, dtype=np.int64)
    for i, d in enumerate(ops["digest"]):
        v = index.get(d)
        if v is None:
            v = index[d] = len(distinct)
            distinct.append(d)
            refs.append(0)
            firsts.append(i)
        refs[v] += 1
        vidx[i] = v
    cols = op_col(shape, np.asarray(layers, dtype=np.int64), np.asarray(slots, dtype=np.int64)).tolist()
    sels, poss = list(ops["sel"]), [tuple(p) for p in ops["pos"]]
    return SteerShape(n, list(ops["layer"]), list(ops["digest"]), distinct, refs, firsts, vidx, cols, sels, poss,
                      earlier,
                      steer_group_index(sels, poss, cols))


class _Known(msgspec.Struct):
    """What a wire of a kept shape is read for: its coefficients, and the layers and vector
    digests `ShapeCache.get` compares; its other columns are skipped, not decoded."""
    layer: Any = None
    digest: Any = None
    c: Any = None


_READ_KNOWN = msgspec.msgpack.Decoder(_Known)


class ShapeCache:
    """Steering shapes by the wire's "ss", the least recently used dropped beyond MAX_SHAPES."""

    def __init__(self):
        self._shapes: OrderedDict[str, SteerShape] = OrderedDict()

    def columns(self, key, blob) -> dict | None:
        """The columns of a wire's steering `blob` that a kept shape `key` needs (with the blob,
        for a vector new to the tables: `full_columns`), or None: not kept, or not a blob."""
        if not isinstance(blob, bytes) or not isinstance(key, str) or key not in self._shapes:
            return None
        try:
            k = _READ_KNOWN.decode(blob)
        except msgspec.MsgspecError:
            return None                  # the full way names what is wrong
        return {"layer": k.layer, "digest": k.digest, "c": k.c, "blob": blob}

    def get(self, key, ops: dict[str, list]) -> SteerShape | None:
        """The shape kept for `key`, if the wire's columns `ops` repeat its layers and vectors
        (else the wire is admitted, and checked, in full)."""
        got = self._shapes.get(key) if isinstance(key, str) else None
        if got is None or ops.get("layer") != got.layers or ops.get("digest") != got.digests:
            return None
        self._shapes.move_to_end(key)
        return got

    def put(self, key, shape: SteerShape) -> None:
        if isinstance(key, str):
            self._shapes[key] = shape
            while len(self._shapes) > MAX_SHAPES:
                self._shapes.popitem(last=False)

    def clear(self) -> None:
        self._shapes.clear()
