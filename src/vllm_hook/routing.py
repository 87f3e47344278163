"""Pure batch-layout math: which batch row gets which steering op and capture destination.

No vLLM, no torch: numpy in, numpy out, so every case (chunked prefill, padding, reordered
batches, pool overflow) is unit-tested without an engine. A request's rows in a step are the
contiguous range [start, start + count); the row at offset i has position first_pos + i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from .spec.resolve import selected_mask


@dataclass(frozen=True)
class SteerRoute:
    col: int                  # layer * ops_per_layer + slot
    op_row: int               # row of the op table
    sel: str
    pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class CaptureRoute:
    point: int                               # capture-index column
    sels: tuple[tuple[str, tuple[int, ...]], ...]
    last_only: bool = False                  # keep only the newest rows (selector "last")
    pool: int = 0                            # which pool (row width) the point writes into


@dataclass(frozen=True)
class RequestRoutes:
    prompt_len: int
    steer: tuple[SteerRoute, ...] = ()
    capture: tuple[CaptureRoute, ...] = ()

    @property
    def horizon(self) -> float:
        """The largest position any route may still select (inf when open-ended)."""
        h = -1.0
        for sel, pos in [(r.sel, r.pos) for r in self.steer] + [s for c in self.capture for s in c.sels]:
            if sel in ("all", "generated", "last"):
                return float("inf")
            h = max(h, self.prompt_len - 1 if sel in ("prompt", "last_prompt") else max(pos))
        return h


@dataclass(frozen=True)
class Rows:
    start: int
    count: int
    first_pos: int


@dataclass(frozen=True)
class Segment:
    owner: Any
    point: int
    pool_start: int
    positions: np.ndarray
    last_only: bool
    pool: int = 0
    rows: np.ndarray | None = None           # batch rows of the captured tokens


@dataclass
class StepRouting:
    segments: list[Segment] = field(default_factory=list)
    pool_used: dict[int, int] = field(default_factory=dict)
    overflow: list[Any] = field(default_factory=list)
    steered_upto: int = 0     # 1 + the last row given a non-identity op


def route_step(
    entries: Iterable[tuple[Any, RequestRoutes, Rows]],
    op_idx: np.ndarray,
    cap_idx: np.ndarray,
    pool_rows: int,
) -> StepRouting:
    """Fill `op_idx` [T, L*K] (pre-zeroed) and `cap_idx` [T, points] (pre-filled with trash rows)
    for the requests in `entries`; return where each captured row lands in the pool."""
    out = StepRouting()
    for owner, routes, rows in entries:
        if rows.count <= 0:
            continue
        positions = rows.first_pos + np.arange(rows.count, dtype=np.int64)
        batch_rows = rows.start + np.arange(rows.count, dtype=np.int64)
        P = routes.prompt_len
        for r in routes.steer:
            m = selected_mask(r.sel, r.pos, positions, P)
            if m.any():
                sel_rows = batch_rows[m]
                op_idx[sel_rows, r.col] = r.op_row
                out.steered_upto = max(out.steered_upto, int(sel_rows[-1]) + 1)
        for c in routes.capture:
            m = np.zeros(rows.count, dtype=bool)
            for sel, pos in c.sels:
                m |= selected_mask(sel, pos, positions, P)
            n = int(m.sum())
            if not n:
                continue
            used = out.pool_used.get(c.pool, 0)
            if used + n > pool_rows:
                if owner not in out.overflow:
                    out.overflow.append(owner)
                continue
            cap_idx[batch_rows[m], c.point] = used + np.arange(n, dtype=np.int64)
            out.segments.append(Segment(owner, c.point, used, positions[m], c.last_only, c.pool,
                                        batch_rows[m]))
            out.pool_used[c.pool] = used + n
    return out
