"""Batch-layout math without an engine: rows, positions, padding, selectors, pool overflow."""

from __future__ import annotations

import numpy as np
import torch

from vllm_hook.model.layout import PointTable
from vllm_hook.adapters.base import StepView
from vllm_hook.routing import CaptureRoute, RequestRoutes, Rows, SteerRoute, group_captures, route_step
from vllm_hook.worker.runtime import broadcast_rows
from vllm_hook.worker.repeat import StepRepeat

L, K = 4, 2


def arrays(T, points=6):
    return np.zeros((T, L * K), np.int64), np.full((T, points), 999, np.int64)


def test_two_requests_chunked_and_decode():
    op, cap = arrays(10)
    a = RequestRoutes(5, steer=(SteerRoute(col=2, entry=7, sel="all"),),
                      capture=(CaptureRoute(point=1, sels=(("all", ()),)),))
    b = RequestRoutes(3, steer=(SteerRoute(col=3, entry=9, sel="generated"),),
                      capture=(CaptureRoute(point=1, sels=(("last_prompt", ()),)),))
    # a: decode row (position 6) at row 0; b: prompt chunk positions 0..2 at rows 1..3.
    r = route_step([("a", a, Rows(0, 1, 6)), ("b", b, Rows(1, 3, 0))], op, cap, pool_rows=100)
    assert op[:, 2].tolist() == [7, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert op[:, 3].tolist() == [0] * 10                  # b has no generated rows yet
    assert cap[:, 1].tolist()[:4] == [0, 999, 999, 1]       # a's row, then b's last prompt token
    assert [(s.owner, s.pool_start, s.positions.tolist()) for s in r.segments] == [("a", 0, [6]), ("b", 1, [2])]
    assert r.pool_used == {0: 2} and r.steered_upto == 1


def test_padding_rows_untouched_and_positions_selector():
    op, cap = arrays(8)
    a = RequestRoutes(4, steer=(SteerRoute(col=0, entry=1, sel="pos", pos=(1, 3)),),
                      capture=(CaptureRoute(point=0, sels=(("prompt", ()),)),))
    r = route_step([("a", a, Rows(2, 4, 0))], op, cap, pool_rows=100)
    assert op[:, 0].tolist() == [0, 0, 0, 1, 0, 1, 0, 0]
    assert cap[:, 0].tolist() == [999, 999, 0, 1, 2, 3, 999, 999]
    assert r.steered_upto == 6


def test_last_selector_and_union():
    op, cap = arrays(4)
    a = RequestRoutes(3, capture=(CaptureRoute(point=2, sels=(("last", ()), ("pos", (0,)))),))
    r = route_step([("a", a, Rows(0, 3, 0))], op, cap, pool_rows=100)
    assert r.segments[0].positions.tolist() == [0, 2]


def test_pools_are_allocated_separately():
    op, cap = arrays(4)
    a = RequestRoutes(4, capture=(CaptureRoute(point=0, sels=(("all", ()),)),
                                  CaptureRoute(point=3, sels=(("all", ()),), pool=1)))
    r = route_step([("a", a, Rows(0, 4, 0))], op, cap, pool_rows=10)
    assert r.pool_used == {0: 4, 1: 4}
    assert cap[:, 0].tolist() == cap[:, 3].tolist() == [0, 1, 2, 3]
    assert [s.pool for s in r.segments] == [0, 1]


def test_pool_overflow_is_reported_not_silent():
    op, cap = arrays(8)
    a = RequestRoutes(8, capture=(CaptureRoute(point=0, sels=(("all", ()),)),))
    b = RequestRoutes(8, capture=(CaptureRoute(point=0, sels=(("all", ()),)),))
    r = route_step([("a", a, Rows(0, 4, 0)), ("b", b, Rows(4, 4, 0))], op, cap, pool_rows=6)
    assert [s.owner for s in r.segments] == ["a"] and r.overflow == ["b"]
    assert (cap[4:, 0] == 999).all()


def test_horizon():
    assert RequestRoutes(5, capture=(CaptureRoute(0, (("last_prompt", ()),)),)).horizon == 4
    assert RequestRoutes(5, steer=(SteerRoute(0, 1, "pos", (7,)),)).horizon == 7
    assert RequestRoutes(5, steer=(SteerRoute(0, 1, "generated"),)).horizon == float("inf")
    # steering and capture selectors together; groups shared by requests of other lengths
    cap = (CaptureRoute(0, (("pos", (2, 9)),)), CaptureRoute(1, (("prompt", ()),)))
    for P, want in ((5, 9), (20, 19)):
        r = RequestRoutes(P, steer=(SteerRoute(0, 1, "pos", (3,)),), capture=cap,
                          shared_cap_groups=group_captures(cap))
        assert r.horizon == want and r.steady_from == max(P, 10)
    assert RequestRoutes(5, steer=(SteerRoute(0, 1, "pos", (3,)),),
                         capture=(CaptureRoute(0, (("last", ()),)),)).horizon == float("inf")


def test_point_table_resid_pre_aliases_previous_resid_post():
    t = PointTable(4, ("resid_post", "resid_pre", "attn_out", "mlp_out"))
    assert t.col("resid_pre", 2) == t.col("resid_post", 1)
    assert t.col("resid_pre", 0) == 4
    assert t.n_points == 4 + 1 + 4 + 4
    assert t.pool_of(t.col("resid_post", 0)) == 0
    assert len({t.col("attn_out", i) for i in range(4)} | {t.col("mlp_out", i) for i in range(4)}) == 8


def test_points_with_one_selection_share_a_point_major_segment():
    op, cap = arrays(3)
    a = RequestRoutes(2, steer=tuple(SteerRoute(col=c, entry=10 + c, sel="all") for c in (0, 2, 4)),
                      capture=tuple(CaptureRoute(point=p, sels=(("all", ()),)) for p in (1, 3, 5)))
    r = route_step([("a", a, Rows(1, 2, 0))], op, cap, pool_rows=100)
    assert op[1:, [0, 2, 4]].tolist() == [[10, 12, 14], [10, 12, 14]] and not op[0].any()
    (seg,) = r.segments
    assert seg.points == (1, 3, 5) and seg.positions.tolist() == [0, 1] and seg.num_rows == 6
    # point g's rows are g*2 + [0, 1]
    assert cap[1:, [1, 3, 5]].tolist() == [[0, 2, 4], [1, 3, 5]]
    assert r.pool_used == {0: 6}


def _route_row_by_row(entries, T, cols, points, pool_rows):
    """Reference: every row and route on its own, selectors via spec.resolve.selected_mask."""
    from vllm_hook.spec.resolve import selected_mask

    op, cap = np.zeros((T, cols), np.int64), np.full((T, points), 999, np.int64)
    used, segs, overflow = {}, [], []
    for owner, routes, rows in entries:
        for i in range(rows.count):
            row, p = rows.start + i, np.array([rows.first_pos + i])
            for r in routes.steer:
                if selected_mask(r.sel, r.pos, p, routes.prompt_len)[0]:
                    op[row, r.col] = r.entry
        for sels, pool, last, pts, ids in routes.capture_groups:
            picked = [rows.first_pos + i for i in range(rows.count)
                      if any(selected_mask(s, q, np.array([rows.first_pos + i]), routes.prompt_len)[0]
                             for s, q in sels)]
            n, u = len(picked), used.get(pool, 0)
            if not n:
                continue
            if u + n * len(ids) > pool_rows:
                overflow.append(owner)
                continue
            for j, pos in enumerate(picked):
                for g, pt in enumerate(ids):
                    cap[rows.start + pos - rows.first_pos, pt] = u + g * n + j
            segs.append((owner, ids, u, picked))
            used[pool] = u + n * len(ids)
    return op, cap, used, segs, overflow


def test_routing_matches_a_row_by_row_reference_on_random_batches():
    """Decode rows (one per request) take route_step's batched path, prefill chunks the
    per-request one (or whole rows, steered at every token): all must place every op and
    capture row where the reference does, also over stale rows route_step is to zero."""
    rng = np.random.default_rng(0)
    sels = [("all", ()), ("prompt", ()), ("generated", ()), ("last_prompt", ()), ("last", ()),
            ("pos", (0, 3, 9))]
    n_points, cols = 12, L * K
    for trial in range(200):
        entries, start = [], 0
        for r in range(rng.integers(1, 7)):
            P = int(rng.integers(1, 12))
            count = 1 if rng.random() < 0.6 else int(rng.integers(2, 6))
            first = int(rng.integers(0, 15))
            every = rng.random() < 0.3              # every token: its chunks' rows written whole
            steer = tuple(SteerRoute(col=int(c), entry=int(100 * (r + 1) + c), sel="all" if every else sels[k][0],
                                     pos=() if every else sels[k][1])
                          for c, k in zip(rng.choice(cols, rng.integers(0, 4), replace=False),
                                          rng.integers(0, len(sels), 4)))
            if entries and rng.random() < 0.5:   # steering alike: the worker shares one routes tuple
                steer = entries[-1][1].steer
            capture = tuple(CaptureRoute(point=int(pt), sels=(sels[int(rng.integers(0, len(sels)))],),
                                         pool=int(rng.integers(0, 2)))
                            for pt in rng.choice(n_points, rng.integers(0, 4), replace=False))
            entries.append((f"r{r}", RequestRoutes(P, steer=steer, capture=capture), Rows(start, count, first)))
            start += count
        T = start + 2                                         # padding rows
        pool_rows = int(rng.integers(4, 40))
        op, cap = np.zeros((T, cols), np.int64), np.full((T, n_points), 999, np.int64)
        got = route_step(entries, op, cap, pool_rows)
        ref_op, ref_cap, ref_used, ref_segs, ref_over = _route_row_by_row(entries, T, cols, n_points, pool_rows)
        assert np.array_equal(op, ref_op), trial
        assert np.array_equal(cap, ref_cap), trial
        assert {k: v for k, v in got.pool_used.items() if v} == {k: v for k, v in ref_used.items() if v}
        # (one-row segments are listed after the others: their order carries no meaning)
        assert sorted((s.owner, s.points, s.pool_start, s.positions.tolist()) for s in got.segments) == \
            sorted((o, ids, u, picked) for o, ids, u, picked in ref_segs), trial
        assert got.overflow == list(dict.fromkeys(ref_over)), trial
        for rows, cs in got.cap_written:     # the entries it reports are all it wrote
            cap[rows, cs] = 999
        assert (cap == 999).all(), trial
        steered = [i for i in range(T) if op[i].any()]
        assert got.steered_upto >= (steered[-1] + 1 if steered else 0)
        # Stale rows (a staging array's last use) below zero_upto: zeroed unless written whole
        z = int(rng.integers(0, T + 1))
        stale = rng.integers(1, 1000, (T, cols))
        stale[z:] = 0
        route_step(entries, stale, np.full((T, n_points), 999, np.int64), pool_rows, zero_upto=z)
        assert np.array_equal(stale, ref_op), trial
        # The GPU's staging: runs of rows steered alike at every token get their first row
        # only, the device copies it over the rest; the same op rows, stale rows or not
        stale = rng.integers(1, 1000, (T, cols))
        stale[z:] = 0
        b = route_step(entries, stale, np.full((T, n_points), 999, np.int64), pool_rows, zero_upto=z,
                       broadcast_from=int(rng.integers(1, 6)))
        broadcast_rows(torch.from_numpy(stale), b.broadcast)
        assert np.array_equal(stale, ref_op), trial
        assert b.steered_upto == got.steered_upto


def test_staging_resets_only_the_capture_entries_its_last_step_wrote():
    """Consecutive steps through one capture array (the CPU's; a GPU's two staging sets each
    keep their own list): resetting the entries the last step wrote leaves the array as a
    fresh trash fill would, each row's own trash row."""
    from types import SimpleNamespace

    import torch

    from vllm_hook.worker.runtime import _Staging

    rng = np.random.default_rng(1)
    T, n_points = 40, 6
    trash = 1000 + np.arange(T)
    stg = _Staging(SimpleNamespace(device=torch.device("cpu"), op_idx=torch.zeros(T, 4, dtype=torch.int64),
                                   cap_idx=torch.zeros(T, n_points, dtype=torch.int64)))
    for step in range(30):
        entries, start = [], 0
        for r in range(rng.integers(0, 5)):
            count = int(rng.integers(1, 8))
            sel = [("all", ()), ("last_prompt", ()), ("pos", (1, 4))][int(rng.integers(0, 3))]
            capture = tuple(CaptureRoute(point=int(pt), sels=(sel,))
                            for pt in rng.choice(n_points, rng.integers(1, 3), replace=False))
            entries.append((f"r{r}", RequestRoutes(5, capture=capture), Rows(start, count, int(rng.integers(0, 6)))))
            start += count
        _, cap = stg.begin()
        stg.clear_captures(cap, trash, whole=step == 17)
        got = route_step(entries, np.zeros((T, 4), np.int64), cap[:start + 1], 1000)
        stg.wrote(got.cap_written)
        ref = np.repeat(trash[:, None], n_points, axis=1)
        route_step(entries, np.zeros((T, 4), np.int64), ref[:start + 1], 1000)
        assert np.array_equal(cap, ref), step


def test_steady_from():
    assert RequestRoutes(5, steer=(SteerRoute(0, 1, "all"),)).steady_from == 5
    assert RequestRoutes(5, steer=(SteerRoute(0, 1, "pos", (2, 9)),),
                         capture=(CaptureRoute(0, (("last", ()),)),)).steady_from == 10


def test_a_steady_decode_step_routes_like_the_one_before():
    """What lets `worker.repeat` skip routing: from `steady_from` on, the next decode step
    writes the same indexes, and its segments differ only by one position."""
    rng = np.random.default_rng(0)
    sels = [("all", ()), ("generated", ()), ("last", ()), ("pos", (3, 40)), ("prompt", ())]
    for _ in range(50):
        entries = []
        for i in range(int(rng.integers(1, 8))):
            P = int(rng.integers(1, 30))
            sel = sels[int(rng.integers(len(sels)))]
            steer = (SteerRoute(col=int(rng.integers(L * K)), entry=i + 1, sel=sel[0], pos=sel[1]),) \
                if rng.random() < 0.6 else ()
            capture = (CaptureRoute(point=int(rng.integers(6)), sels=(sels[int(rng.integers(len(sels)))],)),) \
                if rng.random() < 0.6 else ()
            routes = RequestRoutes(P, steer, capture)
            entries.append((f"r{i}", routes, routes.steady_from + int(rng.integers(0, 5))))
        first = [(o, r, Rows(i, 1, p)) for i, (o, r, p) in enumerate(entries)]
        op1, cap1 = arrays(8)
        step1 = route_step(first, op1, cap1, pool_rows=100)
        op2, cap2 = arrays(8)
        step2 = route_step([(o, r, Rows(i, 1, p + 1)) for i, (o, r, p) in enumerate(entries)], op2, cap2, 100)
        assert (op1 == op2).all() and (cap1 == cap2).all()
        assert step1.pool_used == step2.pool_used and step1.steered_upto == step2.steered_upto
        assert [(s.owner, s.points, s.pool_start, (s.positions + 1).tolist(), s.rows.tolist()) for s in step1.segments] == \
            [(s.owner, s.points, s.pool_start, s.positions.tolist(), s.rows.tolist()) for s in step2.segments]


class _Owner:
    attn_jobs: dict = {}


def _view(index, computed, padded=None):
    return StepView(index=dict(index), query_start_loc=np.arange(len(index) + 1),
                    num_computed=np.array(computed), num_tokens=len(index),
                    num_tokens_padded=padded or len(index))


def test_step_repeat_checks_the_layout_every_step():
    a = RequestRoutes(3, steer=(SteerRoute(0, 1, "all"),), capture=(CaptureRoute(0, (("all", ()),)),))
    owner = _Owner()
    entries = [(owner, a, Rows(1, 1, 5))]
    routing = route_step(entries, *arrays(2), pool_rows=10)
    rep = StepRepeat()
    rep.remember(_view({"x": 0, "a": 1}, [9, 5]), routing, entries, routes_changed=False)
    assert rep.next(_view({"x": 0, "a": 1}, [10, 6])) == (routing, 1)
    assert rep.next(_view({"x": 0, "a": 1}, [11, 7])) == (routing, 2)
    assert rep.next(_view({"a": 0, "x": 1}, [8, 12])) is None           # rows moved
    assert rep.next(_view({"x": 0, "a": 1}, [12, 8])) is None           # forgotten until routed again
    for view, ok in ((_view({"x": 0, "a": 1}, [9, 5]), True),
                     (_view({"x": 0, "a": 1}, [9, 5], padded=4), True)):
        rep.remember(view, routing, entries, routes_changed=False)
        assert (rep.next(_view({"x": 0, "a": 1}, [10, 6], padded=view.num_tokens_padded)) is not None) == ok
    rep.remember(_view({"x": 0, "a": 1}, [9, 5]), routing, entries, routes_changed=False)
    assert rep.next(_view({"x": 0, "a": 1}, [10, 6], padded=4)) is None  # padding changed
    rep.remember(_view({"x": 0, "a": 1}, [9, 5]), routing, entries, routes_changed=False)
    assert rep.next(_view({"x": 0, "a": 1}, [10, 7])) is None           # a moved two positions
    # Not remembered: a prompt row, a position before steady_from, a route that ended.
    for ents, changed in (([(owner, a, Rows(1, 2, 5))], False), ([(owner, a, Rows(1, 1, 2))], False),
                          (entries, True)):
        rep.remember(_view({"x": 0, "a": 1}, [9, 5]), routing, ents, routes_changed=changed)
        assert rep.next(_view({"x": 0, "a": 1}, [10, 6])) is None


def test_op_slots_share_a_slot_on_disjoint_positions():
    from vllm_hook.routing import op_slots

    assert op_slots([("all", []), ("all", [])]) == ([0, 1], [[], [0]], False)
    # a vector per position: one slot
    assert op_slots([("pos", [3]), ("pos", [4]), ("pos", [5])]) == ([0, 0, 0], [[], [], []], False)
    # a named op first: every per-position op sits above it
    assert op_slots([("all", []), ("pos", [4]), ("pos", [5])]) == ([0, 1, 1], [[], [0], [0]], False)
    # a named op after several per-position ops of one slot meets a different op on each row
    assert op_slots([("pos", [3]), ("pos", [4]), ("all", [])]) == ([0, 0, 1], [[], [], [-1]], True)
    # overlapping position lists stack
    assert op_slots([("pos", [1, 2]), ("pos", [2, 3]), ("pos", [5])])[0] == [0, 1, 0]


def test_selector_spans_equal_the_masks():
    """Named selectors route a prompt chunk by slices (`routing._span`): the same rows as
    `selected_mask` picks, for chunks before, across and after the prompt's end."""
    from vllm_hook.routing import _span
    from vllm_hook.spec.resolve import selected_mask

    for sel in ("all", "prompt", "generated", "last_prompt", "last"):
        for P in (1, 2, 7):
            for first in range(0, 10):
                for count in (1, 2, 5):
                    a, b = _span(sel, P, first, count)
                    mask = selected_mask(sel, [], first + np.arange(count), P)
                    assert np.flatnonzero(mask).tolist() == list(range(a, b)), (sel, P, first, count)
    assert _span("pos", 3, 0, 4) is None


def test_evenly_spaced_columns_are_written_as_a_slice():
    from vllm_hook.routing import _as_slice

    a = np.zeros((3, 10), np.int64)
    for cols in ([0, 2, 4, 6], [3], [1, 2, 3], [5, 1], [0, 1, 3], []):
        c = np.array(cols, dtype=np.int64)
        s = _as_slice(c)
        assert isinstance(s, slice) == (len(cols) == 1 or (len(cols) > 1 and cols in ([0, 2, 4, 6], [1, 2, 3])))
        b, ref = a.copy(), a.copy()
        b[:, s] = np.arange(len(cols)) + 1
        ref[:, c] = np.arange(len(cols)) + 1
        assert np.array_equal(b, ref), cols


def test_prompt_chunks_steered_alike_merge_into_one_broadcast():
    steer = tuple(SteerRoute(col=c, entry=7 + c, sel="all") for c in range(0, L * K, K))
    alike = RequestRoutes(4, steer=steer)
    other = RequestRoutes(4, steer=steer[:1])
    entries = [("a", alike, Rows(0, 4, 0)), ("b", alike, Rows(4, 4, 0)), ("c", other, Rows(8, 4, 0)),
               ("d", alike, Rows(12, 4, 0))]
    op = np.full((18, L * K), 5, np.int64)
    r = route_step(entries, op, np.full((18, 2), 9, np.int64), pool_rows=10, zero_upto=18, broadcast_from=5)
    assert r.broadcast == [(0, 8)]          # a and b merged; c and d too short on their own
    assert (op[1:8] == 5).all()             # left for the device copy
    assert (op[8:12] == op[8]).all() and (op[12:16] == op[0]).all() and not op[16:].any()
    broadcast_rows(torch.from_numpy(op), r.broadcast)
    assert (op[:8] == op[0]).all() and op[0].any() and not (op[8] == op[0]).all()


def test_many_broadcast_runs_are_copied_by_one_gather():
    """Prompts each steered its own way (a scale per request): their runs are copied over in one
    gather and one scatter, the same rows as a copy per run."""
    from vllm_hook.routing import broadcast_sources

    rng = np.random.default_rng(5)
    for trial in range(20):
        starts = np.sort(rng.choice(200, size=int(rng.integers(3, 12)), replace=False)) * 10
        runs = [(int(s), int(rng.integers(1, 11))) for s in starts]
        op = rng.integers(0, 1000, (2100, 6))
        ref = op.copy()
        for s, c in runs:
            ref[s + 1:s + c] = ref[s]
        t = torch.from_numpy(op)
        broadcast_rows(t, runs)
        assert np.array_equal(op, ref), trial
        src, dst = broadcast_sources(runs)
        assert len(dst) == sum(c - 1 for _, c in runs) and not set(dst) & {s for s, _ in runs}
