"""A batched hook's per-step group (worker/hooks.py), without an engine: rows in row order
whatever order the requests were planned in, and a request whose hook failed at an earlier
layer is left out of the later calls of the step."""

import torch

from vllm_hook.config import HookConfig
from vllm_hook.hooks.hook import Hook
from vllm_hook.worker.hooks import WorkerHooks


class _Access:
    def __call__(self, name):
        raise KeyError(name)


def test_group_rows_and_a_failure_between_layers():
    wh = WorkerHooks(_Access(), 4, {2, 3}, HookConfig(hook_layers="all"), 1e4)
    seen = []

    def fn(ctx, h):
        seen.append((ctx.layer_idx, [c.request_id for c in ctx.requests], ctx.segments, h[:, 0].tolist()))

    hook = Hook(fn, [1, 2], batched=True)
    wh._built["d"] = hook
    reqs = {rid: wh.for_request(rid, 8, [{"i": 0, "digest": "d"}], []) for rid in ("a", "b", "c")}
    hs, res = torch.arange(6.0)[:, None].repeat(1, 4), torch.zeros(6, 4)
    # planned out of row order: c (rows 4-5), a (row 0), b (rows 1-3)
    wh.plan([(reqs["c"], 4, 2, 8), (reqs["a"], 0, 1, 8), (reqs["b"], 1, 3, 8)])
    wh.run(2, hs, res)                                       # after layer 1
    reqs["b"].spec[0].fail("test")                           # b's hook fails between the layers
    wh.run(3, hs, res)                                       # after layer 2
    assert seen[0] == (1, ["a", "b", "c"], [(0, 1), (1, 3), (4, 2)], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert seen[1] == (2, ["a", "c"], [(0, 1), (1, 2)], [0.0, 4.0, 5.0])
    assert reqs["b"].spec[0].errors == ["hook 0: test; it runs no more for this request"]


def test_call_logs_keep_each_requests_rows_across_steps_and_group_changes():
    """Batched saves in steady decode go to one CallLog per group and key (one append per
    call, not per request); a request joining or leaving, a failure or a reorder starts new
    ones. Whatever happens, each request's saved rows are its own rows of every call, in call
    order, and nbytes counts them."""
    from vllm_hook.hooks.state import CallLog, decode, encode, nbytes

    wh = WorkerHooks(_Access(), 4, {2, 3}, HookConfig(hook_layers="all"), 1e4)

    def fn(ctx, h):
        ctx.save("h", h * 1.0)
        ctx.save("first", h[:, :1] * 1.0, per_request=False)
        ctx.save("one", torch.stack([h[a, :2] for a, _ in ctx.segments]), per_request=True)
        for c, (a, n) in zip(ctx.requests, ctx.segments):     # each request's rows, by hand
            c.saved.setdefault("_ref", []).append(h[a:a + n].clone())

    hook = Hook(fn, [1, 2], batched=True)
    wh._built["d"] = hook
    reqs = {rid: wh.for_request(rid, 8, [{"i": 0, "digest": "d"}], []) for rid in "abcd"}

    def step(layout, k):
        wh.plan([(reqs[r], start, n, 8 + k) for r, start, n in layout])
        rows = max(s + n for _, s, n in layout)
        hs = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 1000 * k
        wh.run(2, hs, torch.zeros_like(hs))
        wh.run(3, hs, torch.zeros_like(hs))

    steady = [("a", 0, 1), ("b", 1, 1), ("c", 2, 1)]
    for k in range(3):
        step(steady, k)                                  # one epoch: the same CallLogs
    logs = [p[0] for p in reqs["a"].spec[0].ctx.saved["h"].pieces]
    assert len(logs) == 1 and isinstance(logs[0], CallLog) and len(logs[0].calls) == 6
    step([("a", 0, 1), ("c", 1, 1)], 3)                  # b left
    step([("a", 0, 1), ("c", 1, 1), ("d", 2, 3)], 4)     # d joined with a prompt chunk
    step([("d", 0, 1), ("a", 1, 1), ("c", 2, 1)], 5)     # reordered: rows sort the group
    reqs["c"].spec[0].fail("test")
    step([("a", 0, 1), ("c", 1, 1), ("d", 2, 1)], 6)     # c failed: not called any more
    for rid, rh in reqs.items():
        saved = rh.spec[0].ctx.saved
        ref = saved.pop("_ref", [])
        got = list(saved["h"])
        assert len(got) == len(ref) and all(torch.equal(x, y) for x, y in zip(got, ref)), rid
        assert all(torch.equal(x, y[:, :1]) for x, y in zip(saved["first"], ref))
        assert all(torch.equal(x, y[:1, :2]) for x, y in zip(saved["one"], ref))
        assert nbytes(saved) == sum(4 * (r.numel() + r.shape[0] + 2) for r in ref)
        back = decode(*reversed(encode([saved], "h")))[0]
        assert all(torch.equal(x, y) for x, y in zip(back["h"], ref))


def test_steady_steps_reuse_the_plan_and_move_positions():
    """A step with the same requests at the same rows reuses the last plan: every hook still
    sees its own rows and this step's positions; a hook that failed in between is not called;
    a changed layout plans anew."""
    wh = WorkerHooks(_Access(), 4, {2, 3}, HookConfig(hook_layers="all"), 1e4)
    seen = []

    def one(ctx, h):
        seen.append(("one", ctx.request_id, ctx.positions.tolist(), h[:, 0].tolist()))

    def many(ctx, h):
        seen.append(("many", [c.request_id for c in ctx.requests], [c.positions.tolist() for c in ctx.requests]))

    wh._built.update({"o": Hook(one, [1]), "m": Hook(many, [2], batched=True)})
    reqs = {rid: wh.for_request(rid, 8, [{"i": 0, "digest": "o"}, {"i": 1, "digest": "m"}], []) for rid in "ab"}
    hs = torch.arange(2.0)[:, None].repeat(1, 4)
    for k in range(3):
        wh.plan([(reqs["a"], 0, 1, 8 + k), (reqs["b"], 1, 1, 20 + k)])
        if k == 2:
            reqs["a"].spec[0].fail("test")
        wh.run(2, hs, None)
        wh.run(3, hs, None)
    assert wh.timing["plans_reused"] == 2
    assert [s for s in seen if s[0] == "one"] == [
        ("one", "a", [8], [0.0]), ("one", "b", [20], [1.0]), ("one", "a", [9], [0.0]),
        ("one", "b", [21], [1.0]), ("one", "b", [22], [1.0])]
    assert [s[2] for s in seen if s[0] == "many"] == [[[8], [20]], [[9], [21]], [[10], [22]]]
    wh.plan([(reqs["b"], 0, 1, 23)])                           # a left: a new plan
    seen.clear()
    wh.run(2, hs, None)
    wh.run(3, hs, None)
    assert wh.timing["plans_reused"] == 2 and seen == [("one", "b", [23], [0.0]), ("many", ["b"], [[23]])]


def test_a_repeated_step_reuses_the_plan_one_position_on():
    """worker/repeat.py's steady decode: `advance` replays the last plan with every request
    one position further, and there is nothing to advance after `forget`."""
    wh = WorkerHooks(_Access(), 4, {2}, HookConfig(hook_layers="all"), 1e4)
    seen = []

    def fn(ctx, h):
        seen.append([(c.request_id, c.positions.tolist()) for c in ctx.requests])

    wh._built["d"] = Hook(fn, [1], batched=True)
    reqs = [wh.for_request(rid, 4, [{"i": 0, "digest": "d"}], []) for rid in "ab"]
    hs = torch.zeros(2, 4)
    assert not wh.advance()                                   # nothing planned yet
    wh.plan([(reqs[0], 0, 1, 10), (reqs[1], 1, 1, 20)])
    wh.run(2, hs, None)
    wh.clear_plan()
    assert wh.advance()
    wh.run(2, hs, None)
    wh.clear_plan()
    assert seen == [[("a", [10]), ("b", [20])], [("a", [11]), ("b", [21])]]
    wh.forget()
    assert not wh.advance()


class _FakeGraph:
    """A CUDA graph on the CPU: capturing runs nothing here (the calls ran eagerly, as
    the real capture records without running); a replay computes the hooks' outputs again
    and writes them where the capture's outputs are, making no saves (a graph's kernels
    write into the addresses captured, and run no Python)."""

    def __init__(self, wh):
        self.wh = wh

    def capture_begin(self, **kw):
        pass

    def capture_end(self):
        pass

    def replay(self):
        from vllm_hook.hooks import state

        state.RECORDING, self.wh.capturing = [], True
        try:
            self.wh._run_all()
            fresh = state.RECORDING
        finally:
            state.RECORDING, self.wh.capturing = None, False
        for (_, _, old, _, _), (_, _, new, _, _) in zip(self.wh.graphs.saves, fresh):
            old.copy_(new)


def _graph_engine(monkeypatch, on: bool, hook: Hook, n: int = 3):
    from vllm_hook.worker import hook_graphs

    wh = WorkerHooks(_Access(), 4, {2, 3}, HookConfig(hook_layers="all", hook_graphs=on), 1e4)
    monkeypatch.setattr(hook_graphs, "_new_graph", lambda: _FakeGraph(wh))
    monkeypatch.setattr(hook_graphs, "_on_gpu", lambda t: True)
    monkeypatch.setattr(hook_graphs.HookGraphs, "_on_side", lambda self, fn: (fn(), True)[1])
    wh.copies = {2: torch.zeros(8, 4), 3: torch.zeros(8, 4)}
    wh._built["d"] = hook
    reqs = [wh.for_request(rid, 4, [{"i": 0, "digest": "d"}], []) for rid in "abc"[:n]]
    return wh, reqs


def _slicing_hook(**kw) -> Hook:
    def fn(ctx, h):          # two saves sliced from one output, as the logit lens's
        o = torch.cat([h[:, :2] * 2, h[:, 2:] + ctx.layer_idx])
        ctx.save(f"a{ctx.layer_idx}", o[:h.shape[0]])
        ctx.save(f"b{ctx.layer_idx}", o[h.shape[0]:])
    return Hook(fn, [1, 2], batched=True, read_only=True, **kw)


def _steps(wh, reqs, k0: int, steps: int) -> None:
    for k in range(k0, k0 + steps):
        for b, cp in wh.copies.items():            # the forward's copies, this step's rows
            cp.copy_(torch.arange(32.0).view(8, 4) * (k + 1) + b)
        if not wh.advance():
            wh.plan([(r, i, 1, 10 + k) for i, r in enumerate(reqs)])
        wh.run_copies()
        wh.clear_plan()


def test_steady_read_only_steps_replay_a_graph_with_the_same_results(monkeypatch):
    """worker/hook_graphs.py: a plan reused CAPTURE_AFTER times is captured (after one
    eager step on the side stream), and later steps replay it; the saves recorded at capture
    are made again after each replay on copies of the outputs. Every request's saved rows
    equal an engine without graphs, step by step, and none aliases the graph's buffers."""
    from vllm_hook.worker.hook_graphs import CAPTURE_AFTER

    results = {}
    for on in (False, True):
        wh, reqs = _graph_engine(monkeypatch, on, _slicing_hook(graphable=True))
        _steps(wh, reqs, 0, 12)
        results[on] = [{k: [t.clone() for t in v] for k, v in r.spec[0].ctx.saved.items()} for r in reqs]
        if on:
            assert wh.timing["graph_captures"] == 1
            assert wh.timing["graph_replays"] == 12 - CAPTURE_AFTER - 1      # one warm step eager
            ptrs = [t.data_ptr() for r in reqs for v in r.spec[0].ctx.saved.values() for t in v]
            assert len(set(ptrs)) == len(ptrs)       # one copy per step, never the buffer itself
    for got, want in zip(results[True], results[False]):
        assert got.keys() == want.keys()
        for key in want:
            assert len(got[key]) == len(want[key]) == 12
            assert all(torch.equal(x, y) for x, y in zip(got[key], want[key])), key


def test_hook_graphs_only_for_graphable_hooks_and_dropped_when_the_batch_changes(monkeypatch):
    """No graph for a hook not marked graphable; a member that fails drops the graph and
    the rest run eagerly; a request leaving plans anew and captures again later; a capture
    that raises (a hook that synchronises) leaves the step eager without failing the hook."""
    wh, reqs = _graph_engine(monkeypatch, True, _slicing_hook())
    _steps(wh, reqs, 0, 10)
    assert wh.timing["graph_captures"] == 0

    wh, reqs = _graph_engine(monkeypatch, True, _slicing_hook(graphable=True))
    _steps(wh, reqs, 0, 8)
    assert wh.timing["graph_captures"] == 1
    reqs[1].spec[0].fail("test")
    _steps(wh, reqs, 8, 3)
    assert wh.graphs.graph is None and wh.timing["graph_captures"] == 1
    assert len(reqs[1].spec[0].ctx.saved["a1"]) == 8 and len(reqs[0].spec[0].ctx.saved["a1"]) == 11
    wh.finish("b", reqs[1])
    _steps(wh, [reqs[0], reqs[2]], 11, 8)                # a new plan: captured again
    assert wh.timing["graph_captures"] == 2 and len(reqs[0].spec[0].ctx.saved["a1"]) == 19

    def sync_hook(ctx, h):
        if wh.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        ctx.save("n", h[:, 0] * 1.0)

    wh, reqs = _graph_engine(monkeypatch, True, Hook(sync_hook, [1], batched=True, read_only=True, graphable=True))
    _steps(wh, reqs, 0, 10)
    assert wh.timing["graph_refusals"] == 1 and wh.timing["graph_captures"] == 0
    assert not any(r.spec[0].failed for r in reqs) and len(reqs[0].spec[0].ctx.saved["n"]) == 10


def test_a_stage_plans_only_its_own_hook_points():
    """Pipeline parallelism: stage 0 holds layers 0 and 1 (hook points 0 to 2). A hook at
    layers 1 and 3 runs at its layer 1 there; one at layer 3 only has nothing to plan (its
    points are the last stage's), so a read-only step's copies are only the stage's own."""
    wh = WorkerHooks(_Access(), 4, {2, 3, 4}, HookConfig(hook_layers="all"), 1e4, local={0, 1, 2})
    seen = []
    wh._built["both"] = Hook(lambda ctx, h: seen.append(("both", ctx.layer_idx)), [1, 3], batched=True)
    wh._built["later"] = Hook(lambda ctx, h: seen.append(("later", ctx.layer_idx)), [3])
    rh = wh.for_request("a", 8, [{"i": 0, "digest": "both"}, {"i": 1, "digest": "later"}], [])
    assert [inst.points for inst in rh.spec] == [((2, 1, False),), ()]
    wh.plan([(rh, 0, 2, 8)])
    assert sorted(wh._plan) == [2]
    wh.run(2, torch.zeros(2, 4), None)
    assert seen == [("both", 1)]


def test_a_read_only_step_without_a_points_copy_fails_its_hooks_not_the_step():
    """After a read-only twin's replay the hooks run on the copies; a point without one (a bug
    of ours) fails those requests' hooks with a message and leaves the step alone."""
    wh = WorkerHooks(_Access(), 4, {2, 3}, HookConfig(hook_layers="all"), 1e4)
    seen = []
    wh._built["d"] = Hook(lambda ctx, h: seen.append(ctx.layer_idx), [1, 2], batched=True, read_only=True)
    rh = wh.for_request("a", 8, [{"i": 0, "digest": "d"}], [])
    wh.plan([(rh, 0, 1, 8)])
    wh.copies[3] = torch.zeros(4, 4)          # point 2's copy missing
    wh.run_copies()
    assert rh.spec[0].failed and "was not copied" in rh.spec[0].errors[0]
    assert seen == []                         # failed at point 2: its layer-2 call does not run
