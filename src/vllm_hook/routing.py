"""Pure batch-layout math: which batch row gets which steering op and capture destination.

No vLLM, no torch: numpy in, numpy out, so every case (chunked prefill, padding, reordered
batches, pool overflow) is unit-tested without an engine. A request's rows in a step are the
contiguous range [start, start + count); the row at offset i has position first_pos + i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from .spec.resolve import selected_mask


class cached_property:
    """`functools.cached_property` without Python 3.11's lock (3.12 dropped it): the first
    reads of a request's groups at admission took about 3 µs there."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


class SteerRoute(NamedTuple):   # one per op (a worker admits plain tuples in this field order)
    col: int                  # op-index column of (layer, slot): model.buffers.op_col
    entry: int                # its op_idx value: model.buffers.pack_op(op row, vector row)
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
    steer: tuple[SteerRoute, ...] = ()       # (or plain tuples in its field order: a worker's)
    capture: tuple[CaptureRoute, ...] = ()
    # `steer_groups` and `capture_groups` made once for every request steering (capturing)
    # alike: `group_steering(steer)`, `group_captures(capture)`
    shared_groups: tuple | None = field(default=None, compare=False, repr=False)
    shared_cap_groups: tuple | None = field(default=None, compare=False, repr=False)

    @cached_property
    def steer_groups(self) -> SteerGroups:
        """Steering routes grouped by selector (`group_steering`)."""
        if self.shared_groups is not None:
            return self.shared_groups
        return group_steering(self.steer) if self.steer else NO_STEERING

    @cached_property
    def capture_groups(self) -> tuple[tuple[tuple, int, bool, np.ndarray, tuple[int, ...]], ...]:
        """Capture routes grouped by selectors (`group_captures`)."""
        return self.shared_cap_groups if self.shared_cap_groups is not None else group_captures(self.capture)

    @cached_property
    def steady_from(self) -> int:
        """From this position on, every route selects the same (each position or none): a
        decode step of this request routes like the one before it (`worker.repeat`)."""
        return max(self.prompt_len, self._reach[2] + 1)

    @property
    def _reach(self) -> tuple[bool, bool, int]:
        """`reach` of every steering and capture selector, from their groups (kept there:
        requests steering or capturing alike share them, and so this)."""
        so, sp, sm = reach(self.steer_groups, True)
        co, cp, cm = reach(self.capture_groups, False)
        return so or co, sp or cp, max(sm, cm)

    @property
    def horizon(self) -> float:
        """The largest position any route may still select (inf when open-ended)."""
        opened, prompt, top = self._reach
        if opened:
            return float("inf")
        return float(max(top, self.prompt_len - 1 if prompt else -1))


def reach(groups: tuple, steering: bool) -> tuple[bool, bool, int]:
    """What `groups`' selectors may select, whatever the prompt's length: (open-ended: some
    select generated tokens; some select prompt tokens by the prompt's length; the largest
    position named, -1 if none). Kept on a `SteerGroups` or `CaptureGroups`."""
    got = getattr(groups, "__dict__", {}).get("_reach")
    if got is not None:
        return got
    opened = prompt = False
    top = -1
    for g in groups:
        for sel, pos in ((g[0], g[1]),) if steering else g[0]:
            if sel in ("all", "generated", "last"):
                opened = True
            elif sel in ("prompt", "last_prompt"):
                prompt = True
            elif pos:
                top = max(top, max(pos))
    got = (opened, prompt, top)
    if hasattr(groups, "__dict__"):
        groups.__dict__["_reach"] = got
    return got


class SteerGroups(tuple):
    """`group_steering`'s groups, with the full op_idx row of a steering whose every group
    selects every token (`full_row`), made once per table width."""

    def full_row(self, width: int) -> np.ndarray | None:
        rows = self.__dict__.setdefault("_rows", {})
        if width not in rows:
            row = None
            if self and all(sel == "all" for sel, *_ in self):
                row = np.zeros(width, dtype=np.int64)
                for _, _, cols, values, _ in self:
                    row[cols] = values
            rows[width] = row
        return rows[width]

    def knowing(self, got: tuple[bool, bool, int]) -> "SteerGroups":
        """These groups, told what their selectors may select (`reach`, known from their shape)."""
        self.__dict__["_reach"] = got
        return self


NO_STEERING = SteerGroups()      # a request that steers nothing (a capture): nothing to group


class CaptureGroups(tuple):
    """`group_captures`'s groups (a tuple that keeps what `reach` found)."""


def group_steering(steer: Sequence[SteerRoute]) -> SteerGroups:
    """Steering routes grouped by selector: (sel, pos, columns, op_idx values, the columns as
    a slice where they are evenly spaced, else the array). One write per group and step, not
    one per op (a request steering every layer has one group)."""
    # (by position: a worker's routes are plain tuples in SteerRoute's field order)
    entries = np.array([r[1] for r in steer], dtype=np.int64)
    return SteerGroups([(sel, pos, cols, entries[idx], sl) for sel, pos, cols, idx, sl in steer_group_index(
        [r[2] for r in steer], [r[3] for r in steer], [r[0] for r in steer])])


def steer_group_index(sels: Sequence[str], poss: Sequence[tuple[int, ...]], cols: Sequence[int]) -> list[tuple]:
    """`group_steering`'s groups by op index: (sel, pos, columns, the ops' indices, the columns
    as a slice or array), for ops given as columns; a group's op_idx values are then
    `entries[indices]` (`worker.steer_shapes`)."""
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(sels, poss)):
        groups.setdefault(key, []).append(i)
    out = []
    for (sel, pos), idx in groups.items():
        c = np.asarray([cols[i] for i in idx], dtype=np.int64)
        out.append((sel, pos, c, np.asarray(idx, dtype=np.int64), _as_slice(c)))
    return out


def group_captures(capture: Sequence[CaptureRoute]) -> tuple[tuple[tuple, int, bool, np.ndarray, tuple[int, ...]], ...]:
    """Capture routes grouped by (selectors, pool, last_only): (sels, pool, last_only, points
    as an index array, the same points as a tuple)."""
    groups: dict[tuple, list[int]] = {}
    for c in capture:
        groups.setdefault((c.sels, c.pool, c.last_only), []).append(c.point)
    return CaptureGroups((sels, pool, last, np.array(pts, dtype=np.int64), tuple(pts))
                         for (sels, pool, last), pts in groups.items())


class Rows(NamedTuple):          # built per hooked request and step: a tuple is cheapest
    start: int
    count: int
    first_pos: int


class Segment(NamedTuple):
    """One request's captured rows of one step for a group of points with the same selection:
    pool rows [pool_start, pool_start + len(points) * len(positions)), point-major (the rows
    of points[0] first, each block in position order). Made per capturing request and step:
    a tuple (a frozen dataclass cost 0.6 µs more each)."""
    owner: Any
    points: tuple[int, ...]
    pool_start: int
    positions: np.ndarray
    last_only: bool
    pool: int = 0
    rows: np.ndarray | None = None           # batch rows of the captured tokens

    @property
    def num_rows(self) -> int:
        return len(self.points) * len(self.positions)


@dataclass
class StepRouting:
    segments: list[Segment] = field(default_factory=list)
    pool_used: dict[int, int] = field(default_factory=dict)
    overflow: list[Any] = field(default_factory=list)
    steered_upto: int = 0     # 1 + the last row given a non-identity op
    # Rows steered alike at every token whose first row alone was written (`route_step`'s
    # `broadcast_from`): (start, count); the caller copies row `start` over the rest on the
    # device (`worker.runtime.broadcast_rows`).
    broadcast: list[tuple[int, int]] = field(default_factory=list)
    # The entries of `cap_idx` written, as (rows, columns) index pairs: the next use of the
    # same array resets just these to trash rows (`worker.runtime._Staging.clear_captures`).
    cap_written: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


def route_step(
    entries: Iterable[tuple[Any, RequestRoutes, Rows]],
    op_idx: np.ndarray,
    cap_idx: np.ndarray,
    pool_rows: int,
    zero_upto: int = 0,
    broadcast_from: int | None = None,
) -> StepRouting:
    """Fill `op_idx` [T, op columns] and `cap_idx` [T, points] (trash rows but where noted in
    `cap_written`: the caller resets those after the step) for
    the requests in `entries`; return where each captured row lands in the pool. Rows of
    `op_idx` from `zero_upto` on must be zero; those below are zeroed where not written whole.
    `broadcast_from`: adjacent prompt chunks steered alike at every token, at least this many
    rows together, get only their first row written and are listed in `broadcast` (the rest
    of their rows hold stale values until the caller's `worker.runtime.broadcast_rows`).

    A decode row (one row per request) takes a path without per-request numpy writes: the
    steering entries and the capture destinations of all decode rows (and of prompt chunks'
    single captured rows) are written with one indexed assignment each, since host time per
    step is what grows with the batch. A prompt chunk steered at every token gets its full
    rows written at once, zeros included, so they need no zeroing first (an all-layer spec's
    8,192-row prefill step: zeroing 3.7 MB, then writing half of it, was most of its routing)."""
    entries = list(entries)
    width = op_idx.shape[1]
    whole = []                                # prompt chunks written whole: (start, end)
    for _, routes, rows in entries:
        if rows.count > 1 and routes.steer and routes.steer_groups.full_row(width) is not None:
            whole.append((rows.start, rows.start + rows.count))
    at = 0
    for a, b in sorted(whole):                # zero the rest below zero_upto
        if a > at and at < zero_upto:
            op_idx[at:min(a, zero_upto)] = 0
        at = max(at, b)
    if at < zero_upto:
        op_idx[at:zero_upto] = 0
    out = StepRouting()
    spans: list[tuple[int, int, np.ndarray]] = []     # prompt chunks steered whole, deferred
    one_rows: list[int] = []                  # decode rows' steering: row, columns, values
    one_cols: list[np.ndarray] = []
    one_vals: list[np.ndarray] = []
    # One-row captures (decode rows, prompt chunks' last tokens): (owner, group, row,
    # position, first pool row), written and made segments together after the loop: per
    # request, numpy calls were most of a last-token capture's routing.
    one_caps: list[tuple] = []

    def one_row(owner, group, row: int, p: int) -> None:
        """Capture one row of a capture group: its destinations join the batched write below."""
        pool, point_ids = group[1], group[4]
        used = out.pool_used.get(pool, 0)
        if used + len(point_ids) > pool_rows:
            if owner not in out.overflow:
                out.overflow.append(owner)
            return
        one_caps.append((owner, group, row, p, used))
        out.pool_used[pool] = used + len(point_ids)

    for owner, routes, rows in entries:
        if rows.count <= 0:
            continue
        P = routes.prompt_len
        if rows.count == 1:
            p, row = rows.first_pos, rows.start
            for sel, pos, cols, values, _ in routes.steer_groups:
                if selected_mask(sel, pos, p, P):
                    one_rows.append(row)
                    one_cols.append(cols)
                    one_vals.append(values)
            for group in routes.capture_groups:
                if any(selected_mask(sel, pos, p, P) for sel, pos in group[0]):
                    one_row(owner, group, row, p)
            continue
        first, count, start = rows.first_pos, rows.count, rows.start
        positions = None
        full = routes.steer_groups.full_row(width) if routes.steer else None
        if full is not None:
            if broadcast_from is None:
                op_idx[start:start + count] = full
            else:
                spans.append((start, count, full))
            out.steered_upto = max(out.steered_upto, start + count)
        for sel, pos, cols, values, col_slice in () if full is not None else routes.steer_groups:
            span = _span(sel, P, first, count)
            if span is not None:              # a contiguous range of the chunk: a slice
                a, b = span
                if a < b:
                    # Columns as a slice where they can be: a strided copy, about twice as
                    # fast as an indexed one (a prompt chunk of an all-layer spec: 28 x rows)
                    op_idx[start + a:start + b, col_slice] = values
                    out.steered_upto = max(out.steered_upto, start + b)
                continue
            if positions is None:
                positions = first + np.arange(count, dtype=np.int64)
            m = selected_mask(sel, pos, positions, P)
            if m.any():
                sel_rows = start + np.flatnonzero(m)
                op_idx[sel_rows[:, None], cols[None, :]] = values[None, :]
                out.steered_upto = max(out.steered_upto, int(sel_rows[-1]) + 1)
        for group in routes.capture_groups:
            sels, pool, last_only, points, point_ids = group
            span = _span(sels[0][0], P, first, count) if len(sels) == 1 else None
            if span is not None and span[1] - span[0] == 1:
                # one row of the chunk (the last prompt token): batched with the decode rows
                one_row(owner, group, start + span[0], first + span[0])
                continue
            if span is not None:
                # a contiguous range of the chunk (a prompt's tokens): written through a slice
                a, b = span
                n = b - a
            else:
                if positions is None:
                    positions = first + np.arange(count, dtype=np.int64)
                m = np.zeros(count, dtype=bool)
                for sel, pos in sels:
                    m |= selected_mask(sel, pos, positions, P)
                idx = np.flatnonzero(m)
                n = len(idx)
            if n <= 0:
                continue
            used = out.pool_used.get(pool, 0)
            total = n * len(points)
            if used + total > pool_rows:
                if owner not in out.overflow:
                    out.overflow.append(owner)
                continue
            # point g's row i lands at used + g*n + i (point-major, see Segment)
            if span is not None:
                sel_rows = np.arange(start + a, start + b, dtype=np.int64)
                picked = np.arange(first + a, first + b, dtype=np.int64)
                at = (slice(start + a, start + b), points)
            else:
                sel_rows, picked = start + idx, first + idx
                at = (sel_rows[:, None], points[None, :])
            cap_idx[at] = used + _block(n, len(points))
            out.cap_written.append(at)
            out.segments.append(Segment(owner, point_ids, used, picked, last_only, pool, sel_rows))
            out.pool_used[pool] = used + total
    if one_caps:
        _write_one_rows(one_caps, cap_idx, out)
    if spans:
        _write_whole(op_idx, spans, broadcast_from, out.broadcast)
    if one_rows:
        counts = [len(c) for c in one_cols]
        op_idx[np.repeat(np.array(one_rows, dtype=np.int64), counts), np.concatenate(one_cols)] = \
            np.concatenate(one_vals)
        out.steered_upto = max(out.steered_upto, max(one_rows) + 1)
    return out


def _write_one_rows(one_caps: list[tuple], cap_idx: np.ndarray, out: StepRouting) -> None:
    """`route_step`'s one-row captures: their pool destinations in one indexed write, their
    segments' positions and rows views of one array each."""
    rows = np.fromiter((c[2] for c in one_caps), dtype=np.int64, count=len(one_caps))
    pos = np.fromiter((c[3] for c in one_caps), dtype=np.int64, count=len(one_caps))
    used = np.fromiter((c[4] for c in one_caps), dtype=np.int64, count=len(one_caps))
    groups = [c[1] for c in one_caps]
    first = groups[0]
    if all(g is first for g in groups):       # one group for all (the common case)
        n = len(first[4])
        at = (np.repeat(rows, n), np.tile(first[3], len(one_caps)))
        vals = (used[:, None] + _offsets(n)[None, :]).ravel()
    else:
        counts = np.fromiter((len(g[4]) for g in groups), dtype=np.int64, count=len(groups))
        starts = np.cumsum(counts) - counts
        at = (np.repeat(rows, counts), np.concatenate([g[3] for g in groups]))
        vals = np.repeat(used - starts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    cap_idx[at] = vals
    out.cap_written.append(at)
    segs = out.segments
    for k, (owner, group, _, _, u) in enumerate(one_caps):
        segs.append(Segment(owner, group[4], u, pos[k:k + 1], group[2], group[1], rows[k:k + 1]))


def _write_whole(op_idx: np.ndarray, spans: list, at_least: int, broadcast: list) -> None:
    """Write prompt chunks steered alike at every token: adjacent chunks with the same row
    merge, and a merged run of `at_least` rows or more gets its first row only (listed in
    `broadcast`). On a GPU this turns an all-layer spec's prefill step from megabytes written
    into pinned host memory (0.45 KB a row at 28 layers; 3.7 MB for 8,192 rows) into one row
    and a device-side copy."""
    spans.sort(key=lambda s: s[0])
    runs: list[list] = []
    for start, count, full in spans:
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[1] == start and (
                last[2] is full or np.array_equal(last[2], full)):
            last[1] += count
        else:
            runs.append([start, count, full])
    for start, count, full in runs:
        if count >= at_least:
            op_idx[start] = full
            broadcast.append((start, count))
        else:
            op_idx[start:start + count] = full


def broadcast_sources(broadcast: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(source rows, destination rows) that copy each listed run's first row over its others
    (`worker.runtime.broadcast_rows`)."""
    runs = np.asarray([(s, c) for s, c in broadcast if c > 1], dtype=np.int64).reshape(-1, 2)
    n = runs[:, 1] - 1
    src = np.repeat(runs[:, 0], n)
    # each run's destinations: its start + 1, + 2, ... (offsets within the run)
    offsets = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    return src, src + 1 + offsets


def _as_slice(cols: np.ndarray) -> slice | np.ndarray:
    """`cols` as the slice that selects them in order when they rise evenly, else `cols`."""
    if len(cols) < 2:
        return slice(int(cols[0]), int(cols[0]) + 1) if len(cols) else cols
    step = int(cols[1] - cols[0])
    if step > 0 and np.array_equal(np.diff(cols), np.full(len(cols) - 1, step)):
        return slice(int(cols[0]), int(cols[-1]) + 1, step)
    return cols


def _span(sel: str, P: int, first: int, count: int) -> tuple[int, int] | None:
    """The rows [a, b) of a chunk of `count` positions from `first` that a named selector
    picks (one range for each but "pos": None), as `selected_mask` would."""
    if sel == "all":
        return 0, count
    if sel == "prompt":
        return 0, min(count, max(0, P - first))
    if sel == "generated":
        return min(count, max(0, P - first)), count
    if sel == "last_prompt":
        i = P - 1 - first
        return (i, i + 1) if 0 <= i < count else (0, 0)
    if sel == "last":
        return min(count, max(0, P - 1 - first)), count
    return None


_ARANGE = np.arange(4096, dtype=np.int64)


def _block(n: int, g: int) -> np.ndarray:
    """[n, g] pool offsets of n rows of g points, point-major (point j's row i at j * n + i)."""
    got = _BLOCKS.get((n, g))
    if got is None:
        got = np.arange(g, dtype=np.int64)[None, :] * n + _offsets(n)[:, None]
        if n * g <= 1 << 16:
            if len(_BLOCKS) >= 256:
                _BLOCKS.clear()
            _BLOCKS[(n, g)] = got
    return got


_BLOCKS: dict[tuple[int, int], np.ndarray] = {}


def _offsets(n: int) -> np.ndarray:
    return _ARANGE[:n] if n <= len(_ARANGE) else np.arange(n, dtype=np.int64)


def op_slots(ops: Sequence[tuple[str, Sequence[int]]]) -> tuple[list[int], list[list[int | None]], bool]:
    """Slots of one layer's ops of one request, in spec order, from their selectors.

    An op goes one slot above every earlier op whose rows it may share: explicit position
    lists share rows only where they intersect, a named selector with every op. So ops on
    disjoint positions (a per-position vector) share one slot. Returns the slots; per op, for
    each lower slot, the earlier op there that shares its rows (None: none; -1: several, on
    different positions); and whether any op has such a -1 (the projection math of a row then
    depends on which op the row met, which one op row cannot hold)."""
    slots: list[int] = []
    earlier: list[list[int | None]] = []
    ambiguous = False
    owners: dict[int, list[tuple[int, int]]] = {}   # position -> (slot, op) of pos ops there
    named_ops: list[int] = []
    for i, (sel, pos) in enumerate(ops):
        if sel == "pos":
            met = {(slots[j], j) for j in named_ops}
            for p in pos:
                met.update(owners.get(p, ()))
        else:
            met = {(slots[j], j) for j in range(i)}
        s = 1 + max((sl for sl, _ in met), default=-1)
        prev: list[int | None] = [None] * s
        for sl, j in met:
            prev[sl] = j if prev[sl] is None or prev[sl] == j else -1
        ambiguous = ambiguous or -1 in prev
        slots.append(s)
        earlier.append(prev)
        if sel == "pos":
            for p in pos:
                owners.setdefault(p, []).append((s, i))
        else:
            named_ops.append(i)
    return slots, earlier, ambiguous
