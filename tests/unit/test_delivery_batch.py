"""One payload per fetch (`delivery.store.batch_to_wire`): every request's results equal what
its own payload gives, bit for bit, whatever is packed and whatever keeps its own entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hook.config import HookConfig
from vllm_hook.delivery import spill
from vllm_hook.delivery.store import PACK_BELOW, RequestStore, batch_to_wire, parse_batch
from vllm_hook.hooks.state import encode
from vllm_hook.model.layout import PointTable
from vllm_hook.results import build

CFG = HookConfig(sites=("resid_post", "resid_pre"))
TABLE = PointTable.for_config(4, CFG)
H = 16


def _request(j: int, big: bool):
    g = torch.Generator().manual_seed(j)
    s = RequestStore()
    P = 5 + j
    s.add((0, 2), np.arange(P), torch.randn(2 * P, H, generator=g).bfloat16(), False)             # prompt chunk
    for step in range(4 if j == 2 else 3):   # j = 2: a surplus step's row, dropped at assembly
        s.add((0, 2), np.array([P + step]), torch.randn(2, H, generator=g).bfloat16(), False)      # decode rows
    if big:                                  # larger than PACK_BELOW: its own entry
        rows = PACK_BELOW // (2 * H) + 4
        s.add((3,), np.arange(rows), torch.randn(rows, H, generator=g).bfloat16(), False)
    tensors, structure = encode([{"ids": [torch.arange(j + 1)], "x": float(j)}], "hk")
    meta = {"req_id": f"r{j}", "errors": [f"e{j}"] if j % 2 else [], "rank": 0, "hooks": structure}
    items = [{"site": "resid_post", "layer": L, "sel": "all", "pos": []} for L in (0, 2)]
    items.append({"site": "resid_pre", "layer": 1, "sel": "all", "pos": []})    # resid_post 0's point
    if big:
        items.append({"site": "resid_post", "layer": 3, "sel": "prompt", "pos": []})
    return s, meta, tensors, items, P


def _same(a, b):
    assert a.errors == b.errors and a.token_ids == b.token_ids
    for site in b.activations:
        for L in b.activations[site]:
            assert torch.equal(a.activations[site][L], b.activations[site][L])
            assert torch.equal(a.positions[site][L], b.positions[site][L])
    assert len(a.hook_results) == len(b.hook_results)
    for x, y in zip(a.hook_results, b.hook_results):
        assert x["x"] == y["x"] and torch.equal(x["ids"][0], y["ids"][0])


def test_batch_payload_equals_per_request_payloads(tmp_path):
    reqs = [_request(j, big=j in (1, 4)) for j in range(6)]
    assert TABLE.col("resid_pre", 1) == TABLE.col("resid_post", 0)
    parts = [(meta, s._tensors(tensors)) for s, meta, tensors, _, _ in reqs]
    for dtype in ("float32", "model"):
        alone = []
        for s, meta, tensors, items, P in reqs:
            blob = s.to_bytes(meta, tensors)
            alone.append(build(blob, items, TABLE, request_id="x", prompt_token_ids=list(range(P)),
                               output_token_ids=[1, 2, 3, 4], hooks=1, dtype=dtype))
        for target in (None, spill.spill_target(str(tmp_path))):     # the RPC's bytes, a shared file
            for parse_dtype in (None, dtype):      # rows converted per request, or once per payload
                wire = batch_to_wire(parts, target, {"rank": 0})
                assert ("path" in wire) == (target is not None)
                buf = spill.open_entry(wire)      # each fetch's buffer is its own
                parsed = parse_batch(buf, parse_dtype)
                assert len(parsed) == len(reqs)
                for (pts, meta), (_, _, _, items, P), ref in zip(parsed, reqs, alone):
                    assert meta["rank"] == 0
                    got = build([(pts, meta, isinstance(buf, torch.Tensor))], items, TABLE, request_id="x",
                                prompt_token_ids=list(range(P)), output_token_ids=[1, 2, 3, 4], hooks=1,
                                dtype=dtype)
                    _same(got, ref)
                    acts = got.activations
                    assert acts["resid_pre"][1] is not acts["resid_post"][0]      # one view each
                    want = torch.float32 if dtype == "float32" else torch.bfloat16
                    assert all(t.dtype == want for t in acts["resid_post"].values())
                    assert got.positions["resid_post"][0].tolist() == list(range(P + 3))
                    if parse_dtype is not None and not meta.get("_fresh"):
                        assert any(j in (1, 4) for j in [int(meta["req_id"][1:])])   # only the big ones
                    # The request's results are its own: writing them changes nobody else's.
                    acts["resid_post"][2].mul_(2.0)
                    assert torch.equal(ref.activations["resid_post"][2] * 2.0, acts["resid_post"][2])
                    got.save(tmp_path / "r.safetensors")


def test_served_requests_finishing_together_share_one_fetch():
    """FetchBatcher: waiters of the same few event-loop turns share one RPC; a failed fetch
    fails all of them and discards their keys; a cancelled waiter does not cancel the others."""
    import asyncio
    from types import SimpleNamespace

    from vllm_hook.frontend.delivery import FetchBatcher

    calls = []

    async def rpc(method, args):
        calls.append(args[:2])
        await asyncio.sleep(0.01)
        if args[0] == "fetch" and "boom" in args[1]:
            raise RuntimeError("worker gone")
        return [{"entries": {k: [{"j": 0, "req_id": k}] for k in args[1]}, "batch": b"payload"}]

    st = SimpleNamespace(cfg=HookConfig(result_spill_dir=None), timing={"fetch_rpc_s": 0.0, "fetches": 0})
    fb = FetchBatcher(st, rpc)

    async def main():
        got = await asyncio.gather(*(fb.entries(f"k{i}") for i in range(5)))
        assert [g[0][0]["req_id"] for g in got] == [f"k{i}" for i in range(5)]
        assert len({id(g[1]) for g in got}) == 1             # one Opened payload for the batch
        assert calls == [("fetch", [f"k{i}" for i in range(5)])]
        # One waiter cancelled: the others still get theirs.
        a, b = asyncio.ensure_future(fb.entries("a")), asyncio.ensure_future(fb.entries("b"))
        await asyncio.sleep(0)
        a.cancel()
        assert (await b)[0][0]["req_id"] == "b"
        # A failing fetch: every waiter of the batch raises, the keys are discarded.
        calls.clear()
        res = await asyncio.gather(fb.entries("boom"), fb.entries("c"), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in res)
        assert calls == [("fetch", ["boom", "c"]), ("discard", ["boom", "c"])]

    asyncio.run(main())
    assert st.timing["fetches"] == 3


def test_served_fetch_leaves_as_the_engine_step_comes_back():
    """FetchBatcher.prefetch (the requests an engine step finished, before vLLM processed
    it): their fetch leaves at once, and each request's `entries` takes its key from it,
    no second RPC; clean or unknown requests are not fetched; a request not prefetched goes
    the usual way; an aborted one's key is let go (`forget`), and unclaimed keys are bounded."""
    import asyncio
    from types import SimpleNamespace

    from vllm_hook.frontend.delivery import EAGER, FetchBatcher

    calls = []

    async def rpc(method, args):
        calls.append(args[:2])
        await asyncio.sleep(0.01)
        return [{"entries": {k: [{"j": 0, "req_id": k}] for k in args[1]}, "batch": b"payload"}]

    res = {f"r{i}": SimpleNamespace(key=f"k{i}", ticket=0, held=False) for i in range(4)}
    st = SimpleNamespace(cfg=HookConfig(result_spill_dir=None), arena_tokens=(),
                         timing={"fetch_rpc_s": 0.0, "fetches": 0, "early_fetches": 0},
                         pending={rid: (0.0, r) for rid, r in res.items()})
    fb = FetchBatcher(st, rpc)

    async def main():
        fb.prefetch(["r0", "r1", "unknown"])
        # Python 3.12+: sent before prefetch returns (an eager task); else at the next turn
        assert calls == ([("fetch", ["k0", "k1"])] if EAGER else [])
        await asyncio.sleep(0)
        assert calls == [("fetch", ["k0", "k1"])]
        got = await asyncio.gather(fb.entries("k1"), fb.entries("k0"), fb.entries("k2"))
        assert [g[0][0]["req_id"] for g in got] == ["k1", "k0", "k2"]
        assert got[0][1] is got[1][1] and got[2][1] is not got[0][1]
        assert calls == [("fetch", ["k0", "k1"]), ("fetch", ["k2"])]
        fb.prefetch(["r3"])
        fb.forget(["k3"])
        assert not fb._early
        fb.MAX_EARLY = 2
        fb.prefetch(["r0", "r1", "r2"])
        assert list(fb._early) == ["k1", "k2"]
        fb.MAX_EARLY, fb.EARLY_TTL_S = 4096, 0.0
        await asyncio.sleep(0.001)
        fb.prefetch(["r3"])                            # older unclaimed keys expire
        assert list(fb._early) == ["k3"]
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert st.timing["early_fetches"] == 4 and st.timing["fetches"] == 5


def test_served_fetch_of_requests_complete_at_their_prompt_while_they_decode():
    """FetchBatcher.hold: requests whose first token came back and whose results were
    complete at their prompt are fetched at once, in one RPC; at their finish no fetch
    leaves for them (`prefetch` skips them) and `entries` takes their rows from the held
    batch; an aborted one's key is let go; FirstTokens maps the engine's ids (assigned after
    admission) to the external ones and is bounded."""
    import asyncio
    from types import SimpleNamespace

    from vllm_hook.frontend.delivery import FetchBatcher, FirstTokens

    calls = []

    async def rpc(method, args):
        calls.append(args[:2])
        await asyncio.sleep(0.01)
        return [{"entries": {k: [{"j": 0, "req_id": k}] for k in args[1]}, "batch": b"payload"}]

    res = {f"r{i}": SimpleNamespace(key=f"k{i}", ticket=0, held=False, dtype="float32", save_dir=None) for i in range(4)}
    st = SimpleNamespace(cfg=HookConfig(result_spill_dir=None), arena_tokens=(), info=SimpleNamespace(dtype="bfloat16"),
                         timing={"fetch_rpc_s": 0.0, "fetches": 0, "early_fetches": 0,
                                 "fetched_while_running": 0, "read_ahead_s": 0.0, "read_s": 0.0, "build_s": 0.0},
                         pending={rid: (0.0, r) for rid, r in res.items()})
    fb = FetchBatcher(st, rpc)

    async def main():
        fb.hold(["r0", "r1", "unknown"])
        fb.hold(["r0"])                                   # held once
        await asyncio.sleep(0.02)
        assert calls == [("fetch", ["k0", "k1"])]
        fb.prefetch(["r0", "r1", "r2"])                   # their finish: only r2 is fetched
        await asyncio.sleep(0)
        assert calls == [("fetch", ["k0", "k1"]), ("fetch", ["k2"])]
        got = await asyncio.gather(fb.entries("k0"), fb.entries("k1"), fb.entries("k2"))
        assert [g[0][0]["req_id"] for g in got] == ["k0", "k1", "k2"]
        assert got[0][1] is got[1][1] and got[2][1] is not got[0][1]
        assert not fb._held
        fb.hold(["r3"])
        fb.forget(["k3"])                                 # aborted while decoding
        assert not fb._held
        await asyncio.sleep(0.02)

    asyncio.run(main())
    assert st.timing["fetched_while_running"] == 3 and st.timing["fetches"] == 3

    ft = FirstTokens(SimpleNamespace(pending={"a": 0}))
    assert not ft
    reqs = [SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")]
    ft.add(reqs[0], "a")
    ft.add(reqs[1], "b")
    reqs[0].request_id, reqs[1].request_id = "a-0000abcd", "b-0000abcd"   # assigned by vLLM later
    assert ft and ft.watching(lambda r: r.request_id) == {"a-0000abcd": "a", "b-0000abcd": "b"}
    ft.MAX = 1
    ft.add(SimpleNamespace(request_id="c-1"), "c")
    assert ft.watching(lambda r: r.request_id) == {"a-0000abcd": "a"}   # b, c: no longer pending
    # admitted on another thread, its engine id not assigned yet: watched once it is
    late = SimpleNamespace(request_id="a", assigned=False)
    ft.MAX = 4096
    ft.add(late, "a")
    ids = lambda r: r.request_id if getattr(r, "assigned", True) else None   # noqa: E731
    assert ft.watching(ids) == {"a-0000abcd": "a"}
    late.request_id, late.assigned = "a-1111abcd", True
    assert ft.watching(ids) == {"a-0000abcd": "a", "a-1111abcd": "a"}


def test_collector_settle_waits_only_for_the_fetched_requests_copies():
    """Collector.settle: completed copies are handed over; of those in flight, it waits up to
    the last one holding rows of the fetched requests (in order), not for later ones."""
    from vllm_hook.delivery.collector import Collector
    from vllm_hook.routing import Segment

    class Event:
        def __init__(self, done):
            self.done, self.waited = done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

    delivered = []
    col = Collector([torch.zeros(8, 4)], lambda seg, rows, blocked=False: delivered.append(seg.owner))
    a, b, c = object(), object(), object()

    def seg(owner, start):
        return Segment(owner, (0,), start, np.array([0]), False)

    hosts = {0: torch.zeros(3, 4)}
    events = [Event(True), Event(False), Event(False)]
    for ev, owner, start in zip(events, (a, b, c), range(3)):
        col._pending.append((ev, hosts, [seg(owner, start)], [], []))
    col.settle({b})
    assert delivered == [a, b] and events[1].waited and not events[2].waited and col.in_flight == 1
    col.settle({object()})                       # no rows in flight: nothing waited for
    assert col.in_flight == 1 and not events[2].waited


def test_arena_lends_pieces_and_reuses_a_range_only_when_both_sides_let_go(monkeypatch):
    """`delivery.arena`: a block's range is free again only when the worker's views died and
    every piece lent from it was released by the frontend; freed neighbours merge; a full
    arena answers None (the caller copies instead); a lent piece reads the same bytes."""
    import gc

    from vllm_hook.delivery import arena as A
    from vllm_hook.delivery.store import batch_to_wire, parse_batch

    a = A.Arena(4 * 100 * 1024, torch.device("cpu"))
    front = A.FrontendArenas()
    front.adopt(a.offer())
    assert front.tokens() == [a.token.hex()]
    x = a.alloc((2, 100, 256), torch.float32)            # 200 KiB: half of it
    y = a.alloc((2, 100, 256), torch.float32)
    assert x is not None and y is not None and a.alloc((1, 100, 256), torch.float32) is None   # full
    x.copy_(torch.randn_like(x))
    want = x[1].clone()
    ref = a.lend(x[1])
    assert ref is not None and a.stats()["arena_pieces_out"] == 1
    del x
    gc.collect()
    assert a.alloc((2, 100, 256), torch.float32) is None   # lent: still held
    got = front.view(ref)
    assert torch.equal(got, want)
    got[0, 0] = 1.0                                        # writable: the user's
    del got
    gc.collect()
    z = a.alloc((2, 100, 256), torch.float32)              # released: reused
    assert z is not None
    del y, z
    gc.collect()
    assert a.stats()["arena_used_bytes"] == 0 and a._free == [(A.HEADER, a.size - A.HEADER)]   # merged

    # Through the wire: large per-request rows travel as references, small ones as bytes.
    rows = a.alloc((4, 200, 64), torch.float32)
    rows.copy_(torch.randn_like(rows))
    parts = [({"req_id": str(j)}, {"g1-2": rows[2 * j:2 * j + 2], "g1-2.pos": torch.arange(200)})
             for j in range(2)]
    wire = batch_to_wire(parts, None, None, a)
    assert set(wire["lent"]) == {"0/g1-2", "1/g1-2"}
    views = front.views(wire["lent"])
    out = parse_batch(wire["blob"], "model", views)
    again = parse_batch(wire["blob"], "float32", front.views(wire["lent"]))   # a second parse
    assert a.stats()["arena_pieces_out"] == 2
    for j, (pts, meta) in enumerate(out):
        assert meta["_owned"] and torch.equal(pts[2][1], rows[2 * j + 1])
    for j, (pts, meta) in enumerate(again):      # float32: each group converted in one copy
        assert meta["_fresh"] == {1, 2} and torch.equal(pts[2][1], rows[2 * j + 1])
    keep = out[0][0][2][1]
    del out, pts, meta, rows, parts, views, again
    gc.collect()
    assert a.stats()["arena_pieces_out"] == 1      # the one piece a result still views
    del keep
    gc.collect()
    assert a.stats()["arena_used_bytes"] == 0

    # A reply that is never parsed (a failed rank, a cancelled fetch): its views go with it.
    rows = a.alloc((2, 300, 64), torch.float32)
    wire = batch_to_wire([({"req_id": "0"}, {"g1": rows})], None, None, a)
    wire["views"] = front.views(wire["lent"])
    del rows, wire
    gc.collect()
    assert a.stats()["arena_used_bytes"] == 0

    # A reply whose write fails keeps nothing lent.
    rows = a.alloc((2, 300, 64), torch.float32)
    from vllm_hook.delivery import store

    def boom(*args, **kwargs):
        raise OSError("no memory for the reply")

    monkeypatch.setattr(store, "st_bytes", boom)
    with pytest.raises(OSError):
        batch_to_wire([({"req_id": "0"}, {"g1": rows})], None, None, a)
    assert a.stats()["arena_pieces_out"] == 0

    # Rows of several chunks: a prompt block and a decode run's strided view (`delivery.runs`:
    # [steps, rows, width] transposed), lent as one reference to both parts, joined (and
    # converted) by the frontend's parse in one copy per part, bit for bit; the pieces go
    # back as soon as they are copied.
    monkeypatch.undo()
    from vllm_hook.delivery.hostmem import Chunked

    prompt = a.alloc((2, 100, 128), torch.float32)
    run_buf = a.alloc((30, 3, 128), torch.float32)           # 30 steps of 3 rows: 2 points + 1
    prompt.copy_(torch.randn_like(prompt))
    run_buf.copy_(torch.randn_like(run_buf))
    steps = run_buf[:, 1:3].transpose(0, 1)                  # [2 points, 30 steps, 128], strided
    want = torch.cat([prompt, steps], dim=1)
    wire = batch_to_wire([({"req_id": "0"}, {"g1-2": Chunked([prompt, steps]), "g1-2.pos": torch.arange(130)})],
                         None, None, a)
    assert len(wire["lent"]["0/g1-2"]["parts"]) == 2 and a.stats()["arena_pieces_out"] == 1   # one flag
    for dtype in ("model", "float32"):
        (pts, meta), = parse_batch(wire["blob"], dtype, front.views(wire["lent"]))
        assert meta["_fresh"] == {1, 2} and meta["_owned"]
        assert torch.equal(pts[1][1], want[0]) and torch.equal(pts[2][1], want[1])
    gc.collect()
    assert a.stats()["arena_pieces_out"] == 0           # copied out: released at once
    del pts, meta, prompt, run_buf, steps, wire, rows
    gc.collect()
    assert a.stats()["arena_used_bytes"] == 0

    # A part not in the arena (a decode step routed on its own) travels by value beside the
    # lent ones.
    prompt = a.alloc((2, 100, 128), torch.float32).normal_()
    step = torch.randn(2, 1, 128)
    wire = batch_to_wire([({"req_id": "0"}, {"g1-2": Chunked([prompt, step]), "g1-2.pos": torch.arange(101)})],
                         None, None, a)
    assert wire["lent"]["0/g1-2"]["parts"][1] is None and "0/g1-2#1" in store._header(wire["blob"])[0]
    (pts, meta), = parse_batch(wire["blob"], "float32", front.views(wire["lent"]))
    assert torch.equal(pts[2][1], torch.cat([prompt, step], dim=1)[1]) and meta["_fresh"] == {1, 2}
    del prompt, pts, meta, wire
    gc.collect()
    assert a.stats()["arena_used_bytes"] == 0 and a.stats()["arena_pieces_out"] == 0

    # Last-token captures: one row per point and request, the requests' rows back to back in
    # two steps' blocks, fetched in another order: lent as one reference (a run per block),
    # nothing packed into the payload; each request gets its own rows, bit for bit.
    # 4 requests x 2 points each in a step's block of 4 KiB: the two blocks lie back to back
    # in the arena, yet are two storages (two runs).
    blocks = [a.alloc((4 * 2, 128), torch.float32).normal_() for _ in range(2)]
    assert blocks[1].data_ptr() == blocks[0].data_ptr() + 4096
    rows = [b[2 * r:2 * r + 2].reshape(2, 1, 128) for b in blocks for r in range(4)]
    order = [4, 0, 5, 2, 7, 1, 3, 6]
    parts = [({"req_id": str(i)}, {"g1-2": rows[i], "g1-2.pos": torch.tensor([7 + i])}) for i in order]
    wire = batch_to_wire(parts, None, None, a)
    assert set(wire["lent"]) == {"g1-2"} and len(wire["lent"]["g1-2"]["parts"]) == 2
    assert "g1-2" not in store._header(wire["blob"])[0]
    for dtype in ("model", "float32", None):
        got = parse_batch(wire["blob"], dtype, front.views(wire["lent"]))
        for (pts, meta), i in zip(got, order):
            assert torch.equal(pts[1][1], rows[i][0]) and torch.equal(pts[2][1], rows[i][1])
            assert pts[2][0].tolist() == [7 + i]
            if dtype is not None:
                assert meta["_fresh"] == {1, 2}
    pts[2][1].add_(1.0)                  # the user's: nobody else's rows change
    assert torch.equal(got[0][0][2][1], rows[order[0]][1])
    del got, pts, meta, wire, rows, parts, blocks
    gc.collect()
    assert a.stats()["arena_used_bytes"] == 0 and a.stats()["arena_pieces_out"] == 0
    # Rows outside the arena (a step too small for it) travel by value beside the lent ones.
    inside = a.alloc((2, 128), torch.float32).normal_().reshape(2, 1, 128)
    wire = batch_to_wire([({"req_id": str(j)}, {"g1-2": t, "g1-2.pos": torch.tensor([3])})
                          for j, t in enumerate([inside, torch.ones(2, 1, 128)])], None, None, a)
    assert sum(p is None for p in wire["lent"]["g1-2"]["parts"]) == 1
    got = parse_batch(wire["blob"], "float32", front.views(wire["lent"]))
    assert torch.equal(got[0][0][1][1], inside[0]) and torch.equal(got[1][0][2][1], torch.ones(1, 128))
    del got, wire, inside
    gc.collect()
    assert a.stats()["arena_used_bytes"] == 0 and a.stats()["arena_pieces_out"] == 0
    # Nothing in the arena: packed as a copy, as before.
    wire = batch_to_wire([({"req_id": str(j)}, {"g1-2": torch.full((2, 1, 128), float(j)), "g1-2.pos": torch.tensor([3])})
                          for j in range(2)], None, None, a)
    assert not wire.get("lent")
    got = parse_batch(wire["blob"], "float32")
    assert torch.equal(got[1][0][2][1], torch.ones(1, 128))


def test_clean_marks_say_fetch_unless_every_rank_marked_the_ticket():
    """A steering-only request skips the fetch only when each rank's arena holds its ticket:
    anything else (unmapped, another ticket, withdrawn by an error, a rank without an arena)
    means fetch."""
    from vllm_hook.delivery import arena as A
    from vllm_hook.worker.runtime import Errors

    r0, r1 = A.Arena(1 << 20, torch.device("cpu")), A.Arena(1 << 20, torch.device("cpu"))
    front = A.FrontendArenas()
    both = (r0.token.hex(), r1.token.hex())
    t, other = (7 << 32) | 5, (7 << 32) | 5 + A.MARKS        # one slot, two requests
    r0.mark_clean(t)
    r1.mark_clean(t)
    assert not front.clean(both, t)                           # not mapped yet
    front.adopt(r0.offer())
    assert not front.clean(both, t) and front.clean(both[:1], t)
    front.adopt(r1.offer())
    assert front.clean(both, t) and not front.clean(both, other) and not front.clean(both, 0)
    assert not front.clean((), t) and not front.clean((both[0], None), t)
    r1.mark_clean(other)                                       # the slot's next request
    assert not front.clean(both, t) and not front.clean(both, other)
    r0.mark_clean(other)
    assert front.clean(both, other)
    r1.unmark(t)                                               # a stale error: not its ticket
    assert front.clean(both, other)
    errors = Errors()
    errors.unmark = lambda: r1.unmark(other)
    errors.append("steering not applied: vector table full")
    assert not front.clean(both, other) and list(errors) == ["steering not applied: vector table full"]
    assert A.MARKS_OFFSET % 8 == 0 and A.MARKS_OFFSET + 8 * A.MARKS <= A.HEADER


def test_frontend_maps_only_an_arena_it_can_verify():
    from vllm_hook.delivery import arena as A

    a = A.Arena(1 << 20, torch.device("cpu"))
    front = A.FrontendArenas()
    front.adopt({**a.offer(), "token": "00" * A.TOKEN_BYTES})     # not that file's token
    front.adopt({**a.offer(), "pid": 1 << 30})                      # no such process
    assert front.tokens() == []
    b = A.Arena(1 << 20, torch.device("cpu"))
    front.adopt({**b.offer(), "boot_id": "another host"})
    assert front.tokens() == []
    front = A.FrontendArenas()
    front.adopt(b.offer())
    assert front.tokens() == [b.token.hex()]
    del b                                   # an in-process engine shut down: its fd is closed
    import gc
    gc.collect()
    assert front.tokens() == []


def test_frontend_maps_an_allocated_arena_in_the_background(monkeypatch):
    """A device worker's arena has all its pages from the start: the frontend maps them into
    its page tables on the background thread when it adopts the arena (`hostmem.populate_soon`),
    so reading lent rows later takes no page fault; a CPU worker's arena is left to fault (its
    pages are allocated as steps first use them)."""
    import mmap
    import os
    import resource

    from vllm_hook.delivery import arena as A
    from vllm_hook.delivery import hostmem

    populated = []
    monkeypatch.setattr(A, "populate_soon", populated.append)
    a = A.Arena(1 << 20, torch.device("cpu"))
    A.FrontendArenas().adopt(a.offer())
    assert not a.offer()["allocated"] and populated == []
    A.FrontendArenas().adopt({**a.offer(), "allocated": True})
    assert len(populated) == 1 and len(populated[0]) == a.size

    fd = os.memfd_create("vh_test")
    os.posix_fallocate(fd, 0, 16 << 20)
    m = mmap.mmap(fd, 16 << 20, flags=mmap.MAP_SHARED)
    os.close(fd)
    hostmem._populate(m)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert int(np.frombuffer(m, dtype=np.uint8)[::4096].sum()) == 0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 64, faults           # unpopulated: 4096 pages, 256 faults or more


def test_collector_falls_back_when_the_arena_is_full():
    """Steps of 64 KiB and more go to the arena while it has room, then the pinned-or-copied
    path; every segment's rows equal the pool's either way, and the arena's ranges come back
    when the rows are dropped."""
    import gc

    import numpy as np

    from vllm_hook.delivery.arena import HEADER
    from vllm_hook.delivery.collector import Collector
    from vllm_hook.routing import Segment, StepRouting

    pool = torch.randn(4096, 64)
    got = []
    # kept as a store keeps them; room for one step (300 rows x 2 requests x 64 floats)
    c = Collector([pool], lambda seg, rows: got.append((seg, rows, c.arena.holds(rows))),
                  arena_bytes=160 << 10)
    for step in range(4):
        pool.normal_()
        want = pool[:600].clone()
        segs = [Segment(owner=i, points=(0, 1), pool_start=300 * i, positions=np.arange(150) + 150 * step,
                        last_only=False) for i in range(2)]
        c.after_forward(StepRouting(segments=segs, pool_used={0: 600}))
        for seg, rows, _ in got[-2:]:
            assert torch.equal(rows, want[seg.pool_start:seg.pool_start + 300])
    assert [h for _, _, h in got] == [True, True, False, False, False, False, False, False]
    got.clear()
    gc.collect()
    assert c.arena.stats()["arena_used_bytes"] == 0 and c.arena._free == [(HEADER, c.arena.size - HEADER)]


def test_offline_fetch_pauses_the_collector_from_the_rpc_on():
    """Decoding a fetch's reply allocates per request; a full collection it would trigger walks
    the whole heap (run 61: 80 ms in one fetch of 256). The RPC runs with the collector
    paused, which comes back on even when the fetch fails (every output keeps its tokens)."""
    import gc
    from types import SimpleNamespace

    from vllm_hook.frontend.delivery import attach
    from vllm_hook.results import ATTR

    seen = []

    def rpc(method, args):
        seen.append((args[0], gc.isenabled()))
        raise RuntimeError("worker gone")

    res = SimpleNamespace(key="k0", ticket=0, held=False)
    st = SimpleNamespace(cfg=HookConfig(result_spill_dir=None), timing={"fetch_rpc_s": 0.0, "fetches": 0},
                         pop_pending=lambda rid: res if rid == "r0" else None, early=None)
    out = SimpleNamespace(request_id="r0", finished=True, prompt_token_ids=[1, 2],
                          outputs=[SimpleNamespace(token_ids=[3], index=0)])
    assert gc.isenabled()
    attach(st, [out], rpc)
    assert seen == [("fetch", False), ("discard", False)] and gc.isenabled()
    got = getattr(out, ATTR)
    assert got.token_ids == [1, 2, 3] and "could not be fetched" in got.errors[0]


def test_attach_takes_an_early_fetchs_keys_from_its_reply():
    """An offline call's fetch sent at its last step (`send_early`): `attach` waits for its
    reply for the keys it took and fetches only the others; a failure of either fails only
    its own requests (each output keeps its tokens), and each fetch's keys are discarded."""
    from types import SimpleNamespace

    from vllm_hook.frontend.delivery import Early, attach, send_early
    from vllm_hook.results import ATTR

    seen = []

    def rpc(method, args):
        seen.append((args[0], list(args[1])))
        raise RuntimeError("worker gone")

    def early_reply(timeout):
        raise RuntimeError("early reply lost")

    ress = {f"r{i}": SimpleNamespace(key=f"k{i}", ticket=0, held=False) for i in range(3)}
    st = SimpleNamespace(cfg=HookConfig(result_spill_dir=None), timing={"fetch_rpc_s": 0.0, "fetches": 0, "early_fetches": 0},
                         pending={rid: (0.0, r) for rid, r in ress.items()}, early=None, arena_tokens=())
    st.pop_pending = lambda rid: st.pending.pop(rid, (0, None))[1]
    sent = []
    send_early(st, ["r1", "r2", "gone"], lambda method, args: sent.append(args[1]) or early_reply)
    assert sent == [["k1", "k2"]] and isinstance(st.early, Early)
    send_early(st, ["r0"], lambda method, args: sent.append(args[1]))      # one per call
    assert len(sent) == 1
    outs = [SimpleNamespace(request_id=rid, finished=True, prompt_token_ids=[1], outputs=[SimpleNamespace(token_ids=[2], index=0)])
            for rid in ress]
    attach(st, outs, rpc)
    assert st.early is None and st.timing["early_fetches"] == 1 and st.timing["fetches"] == 2
    assert seen == [("discard", ["k1", "k2"]), ("fetch", ["k0"]), ("discard", ["k0"])]
    errs = [getattr(o, ATTR).errors[0] for o in outs]
    assert "worker gone" in errs[0] and all("early reply lost" in e for e in errs[1:]), errs


def test_requests_delivered_without_a_fetch_are_built_with_the_collector_paused(monkeypatch):
    """A steering-only batch marked clean is built without an RPC; its build copies every
    request's token lists, and a full collection landing there stalled a batch of 256 by
    0.4 to 0.5 s (runs 101, 102). Built with the collector paused, as a fetched batch is."""
    import gc
    from types import SimpleNamespace

    from vllm_hook.frontend import delivery as D

    seen = []
    monkeypatch.setattr(D, "nothing_to_fetch", lambda st, res: True)
    monkeypatch.setattr(D, "_attach_each", lambda st, todo, fetched, failure, opened:
                        seen.append(([o.request_id for o, _ in todo], gc.isenabled())))
    res = SimpleNamespace(key="k0", ticket=5, fetches=False, save_dir=None)
    st = SimpleNamespace(pop_pending=lambda rid: res, early=None)
    out = SimpleNamespace(request_id="r0", finished=True)

    def rpc(*a, **k):
        raise AssertionError("no fetch for a clean request")

    assert gc.isenabled()
    D.attach(st, [out], rpc)
    assert seen == [(["r0"], False)] and gc.isenabled()
    # Served, each request's results alike, fetched or not.
    monkeypatch.setattr(D, "_tokens_only", lambda *a: seen.append(("served", gc.isenabled())))
    D.results_for(st, out, [], res, wire=True)
    assert seen[-1] == ("served", False) and gc.isenabled()
    monkeypatch.setattr(D, "_results_for", lambda *a: seen.append(("fetched", gc.isenabled())))
    D.results_for(st, out, [], SimpleNamespace(fetches=True, save_dir=None), wire=True)
    assert seen[-1] == ("fetched", False) and gc.isenabled()


@pytest.mark.parametrize("mapped_from", [0, spill.MAPPED_FROM])
def test_rows_of_several_chunks_are_written_part_by_part(tmp_path, monkeypatch, mapped_from):
    """A request's rows from several steps (a prompt chunk, then a decode run's strided view)
    reach the payload part by part, with no concatenated copy first: the same bytes as their
    concatenation, through a fresh file, a reused one (through a mapping, or pwrite for a
    small payload) and the RPC's bytes."""
    monkeypatch.setattr(spill, "MAPPED_FROM", mapped_from)
    from vllm_hook.delivery.hostmem import Chunked

    g = torch.Generator().manual_seed(0)
    run = torch.randn(6, 10, H, generator=g).bfloat16()          # a decode run: [steps, rows, width]
    s = RequestStore()
    s.add((0, 2), np.arange(4), torch.randn(8, H, generator=g).bfloat16(), False)      # prompt, point-major
    s.add((0, 2), np.arange(4, 10), run[:, 3:5].transpose(0, 1), False, blocked=True)  # [points, steps, width]
    tensors = s._tensors()
    assert isinstance(tensors["g0-2"], Chunked) and tensors["g0-2"].shape == (2, 10, H)
    (_, pos, ref), = s.blocks()
    assert torch.equal(ref[:, 4:], run[:, 3:5].transpose(0, 1))
    target = spill.spill_target(str(tmp_path))
    for where in (target, target, None):          # a fresh file, the handed-back one reused, bytes
        wire = batch_to_wire([({"req_id": "r0"}, tensors)], where)
        assert ("path" in wire) == (where is not None)
        (pts, _), = parse_batch(spill.open_entry(wire))
        assert torch.equal(pts[0][1], ref[0]) and torch.equal(pts[2][1], ref[1])
        assert pts[0][0].tolist() == list(range(10))


def test_small_host_ops_run_on_one_thread_large_copies_on_torchs(monkeypatch):
    """Waking torch's sleeping threads for a small tensor cost about a millisecond a parallel
    op on the H200 host (run 65): the plugin's host work runs on one thread; large copies get
    torch's threads back, and the count is restored after, also on an error."""
    from vllm_hook.delivery import hostmem

    n0 = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    real = torch.Tensor.copy_

    def spy(self, src, *a, **k):
        seen.append((self.numel() * self.element_size(), torch.get_num_threads()))
        return real(self, src, *a, **k)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    small, large = torch.empty(1024), torch.empty(2 << 20)           # 4 KiB, 8 MiB
    with hostmem.one_thread():
        assert torch.get_num_threads() == 1
        with hostmem.one_thread():                                    # nested: unchanged
            assert torch.get_num_threads() == 1
        hostmem.copy_many([(small, torch.ones(1024))])
        hostmem.copy_many([(large, torch.ones(2 << 20, dtype=torch.bfloat16))])
        assert torch.get_num_threads() == 1
    assert seen == [(4096, 1), (8 << 20, 2)] and torch.get_num_threads() == 2
    assert large.sum().item() == 2 << 20
    # Many parts (a payload's) too: torch's threads, not the plugin's copy threads (run 67)
    seen.clear()
    dsts = [torch.empty(1 << 15) for _ in range(40)]                    # 40 x 128 KiB, apart
    with hostmem.one_thread():
        hostmem.copy_many([(d, torch.full((1 << 15,), float(i))) for i, d in enumerate(dsts)])
    assert [d[0].item() for d in dsts] == list(range(40)) and {t for _, t in seen} == {2}
    with pytest.raises(RuntimeError):
        with hostmem.one_thread():
            raise RuntimeError
    assert torch.get_num_threads() == 2
    torch.set_num_threads(n0)


def test_host_memory_is_reused_once_no_tensor_views_it(monkeypatch):
    """Fresh pages cost the kernel's zeroing (6 MiB: 722 against 90 µs on the H200 host, run
    67): host_empty's mappings come back for reuse when their last view dies, never before,
    by size (to twice the size asked), up to the kept total."""
    from vllm_hook.delivery import hostmem

    rec = hostmem.Recycler(keep=24 << 20)
    monkeypatch.setattr(hostmem, "RECYCLER", rec)
    a = hostmem.host_empty((6 << 20,), torch.uint8)
    view = a[10:20]
    ptr = a.data_ptr()
    del a
    b = hostmem.host_empty((6 << 20,), torch.uint8)             # `view` still holds the first
    assert b.data_ptr() != ptr
    del view
    c = hostmem.host_empty((5 << 20,), torch.uint8)             # taken back, fits: reused
    assert c.data_ptr() == ptr
    # its storage is its own bytes, not the mapping: a pickle of it carries no earlier contents
    assert c.untyped_storage().nbytes() == 5 << 20
    c.fill_(7)
    del c
    assert hostmem.host_empty((1 << 23,), torch.uint8).data_ptr() != ptr     # the like size only
    big = hostmem.host_empty((20 << 20,), torch.uint8)
    del b, big
    rec.take(1 << 40)                                           # reap: over `keep`, unmapped
    assert rec.idle_bytes <= 24 << 20
    # a result kept at the head of the queue does not hold back those freed after it
    kept = hostmem.host_empty((4 << 20,), torch.uint8)
    for _ in range(70):
        hostmem.host_empty((4 << 20,), torch.uint8)
    assert len(rec.lent) < 64 and kept.numel() == 4 << 20


def test_idle_mappings_of_a_workload_no_longer_run_give_way(monkeypatch):
    """Idle mappings over `keep` are unmapped longest idle first, so the sizes of a workload
    no longer run do not hold the room for good: after large results, results too small to
    fit those mappings (a mapping serves sizes down to half its own) are reused from their
    second batch on (run 153: 254 page faults a request every batch)."""
    from vllm_hook.delivery import hostmem

    rec = hostmem.Recycler(keep=60 << 20)
    monkeypatch.setattr(hostmem, "RECYCLER", rec)
    wide = [hostmem.host_empty((16 << 20,), torch.uint8) for _ in range(3)]
    del wide
    rec.take(1 << 40)                                           # reap: three idle, 54 MiB
    assert rec.idle_bytes == 3 * (18 << 20)
    narrow = [hostmem.host_empty((4 << 20,), torch.uint8) for _ in range(3)]   # fresh: none fits
    ptrs = {t.data_ptr() for t in narrow}
    del narrow
    rec.take(1 << 40)
    assert rec.idle_bytes <= 60 << 20 and len(rec.idle.get(6 << 20, ())) == 3, rec.idle.keys()
    again = [hostmem.host_empty((4 << 20,), torch.uint8) for _ in range(3)]
    assert {t.data_ptr() for t in again} == ptrs                # reused


def test_host_memory_for_the_next_batch_is_readied_in_the_background(monkeypatch):
    """A user keeping a batch's outputs while the next one runs frees them only after the
    next batch's results are built: `refill_soon` (after each delivery) maps and faults in
    as many mappings as the last delivery took, on a background thread, so the next finds
    its memory ready; within `keep`. From 1 MiB (a 128-token, 4-layer float32 capture is
    3 MiB) tensors come from such mappings; huge pages only from 4 MiB."""
    from vllm_hook.delivery import hostmem

    rec = hostmem.Recycler(keep=32 << 20)
    monkeypatch.setattr(hostmem, "RECYCLER", rec)
    first = [hostmem.host_empty((3 << 20,), torch.uint8), hostmem.host_empty((6 << 20,), torch.uint8)]
    assert first[1].data_ptr() % hostmem.HUGE == 0
    rec.refill_soon()                     # the user still holds `first`
    hostmem._filler().submit(lambda: None).result()           # the fill is done
    assert rec.refills == 2 and rec.idle_bytes == (3 << 20) + (8 << 20)
    ready = {m_ptr for m_ptr in (torch.frombuffer(m, dtype=torch.uint8).data_ptr()
                                 for ms in rec.idle.values() for _, m in ms)}
    second = [hostmem.host_empty((3 << 20,), torch.uint8), hostmem.host_empty((6 << 20,), torch.uint8)]
    assert second[0].data_ptr() in ready and rec.idle_bytes == 0
    second[0].fill_(1)
    assert not first[0].eq(1).all()
    # bounded: a refill stops at `keep`
    rec.taken = {(16 << 20, True): 4}
    rec.refill_soon()
    hostmem._filler().submit(lambda: None).result()
    assert rec.idle_bytes <= 32 << 20


def test_served_results_travel_in_the_model_dtype_and_load_as_float32(tmp_path):
    """A served float32 request's rows stay bfloat16 on the server and on the wire (half the
    bytes to convert, encode and send); `Results.from_bytes` widens them: bit for bit the
    results an offline float32 request gets."""
    from types import SimpleNamespace

    from vllm_hook.frontend.delivery import Opened, results_for
    from vllm_hook.results import Results

    reqs = [_request(j, big=j == 1) for j in range(3)]
    payload = batch_to_wire([(meta, s._tensors(tensors)) for s, meta, tensors, _, _ in reqs], None, {"rank": 0})
    st = SimpleNamespace(info=SimpleNamespace(dtype="bfloat16", name="m", head_dim=4), points=TABLE,
                         timing={"read_s": 0.0, "build_s": 0.0})
    for j, (_, meta, _, items, P) in enumerate(reqs):
        res = SimpleNamespace(dtype="float32", items=items, fetches=True, save_dir=None, hooks=1)
        out = SimpleNamespace(request_id=meta["req_id"], prompt_token_ids=list(range(P)),
                              outputs=[SimpleNamespace(index=0, token_ids=[1, 2, 3, 4])])
        entries = [{"payload": payload, "j": j, "req_id": meta["req_id"]}]
        offline = results_for(st, out, entries, res, Opened())
        served = results_for(st, out, entries, res, Opened(), wire=True)
        assert served.widen_to == "float32" and offline.widen_to is None
        assert all(t.dtype == torch.bfloat16 for t in served.activations["resid_post"].values())
        sent, full = served.to_bytes(), offline.to_bytes()
        act_bytes = sum(t.numel() * 4 for d in offline.activations.values() for t in d.values())
        assert len(full) - len(sent) >= act_bytes // 2 - 4096
        loaded = Results.from_bytes(sent)
        assert all(t.dtype == torch.float32 for d in loaded.activations.values() for t in d.values())
        _same(loaded, offline)
        # Stacked sites (for a client that reads them): the same Results from fewer tensors.
        _same(Results.from_bytes(served.to_bytes(stacked=True)), offline)
        served.save(tmp_path / "r.safetensors")          # a file the server saves loads the same
        _same(Results.load(tmp_path / "r.safetensors"), offline)
        # A float32 model's results are float32 already: nothing to widen.
        st32 = SimpleNamespace(**{**vars(st), "info": SimpleNamespace(dtype="float32", name="m", head_dim=4)})
        assert results_for(st32, out, entries, res, Opened(), wire=True).widen_to is None


def test_stacked_sites_load_as_per_layer_ones():
    """`to_bytes(stacked=True)`: a site whose layers share positions, shape and dtype travels as
    one tensor, layers ascending (a block viewed where they lie back to back in it, else
    stacked); others per layer. `from_bytes` gives the same Results either way."""
    from vllm_hook.results import Results, _stack

    block, pos = torch.randn(4, 2, 6).bfloat16(), torch.tensor([5, 6])
    order = (21, 3, 15, 9)                      # inserted out of order
    acts = {"resid_post": {L: block[i] for i, L in enumerate(sorted(order))},
            "mlp_out": {L: torch.randn(2, 6).bfloat16() for L in order},
            "attn_out": {1: torch.randn(2, 6).bfloat16(), 2: torch.randn(3, 6).bfloat16()},   # shapes differ
            "q": {4: torch.randn(2, 2, 3).bfloat16()}}                                       # one layer
    poss = {"resid_post": {L: pos for L in order}, "mlp_out": {L: pos for L in order},
            "attn_out": {1: pos, 2: torch.tensor([4, 5, 6])}, "q": {4: pos}}
    r = Results(request_id="r", prompt_len=7, token_ids=list(range(9)), activations=acts, positions=poss,
                widen_to="float32", heads={"q": {4: [0, 1]}})
    viewed, _ = _stack(acts["resid_post"], poss["resid_post"])
    assert viewed.data_ptr() == block.data_ptr() and torch.equal(viewed, block)
    copied, _ = _stack(acts["mlp_out"], poss["mlp_out"])
    assert torch.equal(copied, torch.stack([acts["mlp_out"][L] for L in sorted(order)]))
    assert _stack(acts["attn_out"], poss["attn_out"]) is None and _stack(acts["q"], poss["q"]) is None
    assert _stack(acts["mlp_out"], {**poss["mlp_out"], 3: pos.clone()}) is None     # positions not shared
    # a block at an offset in its storage (a request's piece of a larger one): viewed there
    big = torch.randn(3, 4, 2, 6).bfloat16()
    at_offset, _ = _stack({L: big[1][i] for i, L in enumerate((2, 5, 7, 9))}, {L: pos for L in (2, 5, 7, 9)})
    assert at_offset.data_ptr() == big[1].data_ptr() and torch.equal(at_offset, big[1])
    zero, none = torch.zeros(3, 0, 6), pos[:0]
    assert _stack({L: zero[L] for L in range(3)}, {L: none for L in range(3)})[0].shape == (3, 0, 6)
    # stacked bytes whose metadata lists other layers than the tensor holds: a clear error
    import json

    from vllm_hook.delivery.store import st_bytes, st_tensors

    tensors, meta = st_tensors(r.to_bytes(stacked=True))
    meta["sites"] = json.dumps({**json.loads(meta["sites"]), "resid_post": [3, 9]})
    with pytest.raises(ValueError, match="stacked 'resid_post' holds 4 layers"):
        Results.from_bytes(st_bytes(tensors, meta))
    per_layer, stacked = Results.from_bytes(r.to_bytes()), Results.from_bytes(r.to_bytes(stacked=True))
    assert len(r.to_bytes(stacked=True)) < len(r.to_bytes())
    for got in (per_layer, stacked):
        assert got.heads == r.heads
        for site, d in acts.items():
            assert sorted(got.activations[site]) == sorted(d)
            for L, t in d.items():
                assert got.activations[site][L].dtype == torch.float32
                assert torch.equal(got.activations[site][L], t.float())
                assert torch.equal(got.positions[site][L], poss[site][L])


def test_safetensors_bytes_are_those_of_safetensors_save():
    """`st_bytes` hands the serializer the tensors' pointers: the same header and data as
    `safetensors.torch.save` (whose metadata keys come in no fixed order), for every dtype the
    plugin sends, empty and strided tensors."""
    import json

    from safetensors.torch import load, save

    from vllm_hook.delivery.store import st_bytes

    base = torch.randn(6, 8)
    tensors = {"token_ids": torch.arange(9), "rows": torch.randn(3, 5).bfloat16(), "f16": torch.randn(2, 2).half(),
               "empty": torch.zeros(0, 0), "pos": torch.tensor([4]), "t": base.t(), "u8": torch.arange(5, dtype=torch.uint8)}
    meta = {"request_id": "r", "errors": "[]"}
    want, got = save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta), st_bytes(tensors, meta)
    n = int.from_bytes(want[:8], "little")
    assert got[:8] == want[:8] and json.loads(got[8:8 + n]) == json.loads(want[8:8 + n])
    assert got[8 + n:] == want[8 + n:]
    back = load(st_bytes(tensors))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_last_token_batch_equals_per_request_payloads(tmp_path):
    """The small-capture path (one row per point and request, as the worker fetches it: numpy
    positions, metadata as columns, `results._build_fresh`) gives each request what its own
    payload gives, bit for bit; a request with errors or other fields, or whose captured row is
    not the one selected, takes the general path with the same result."""
    items = [{"site": "resid_post", "layer": L, "sel": "last_prompt", "pos": []} for L in (0, 2)]
    reqs = []
    for j in range(7):
        s, P = RequestStore(), 6 + j
        last = P - 1 if j != 5 else P - 2          # j = 5: not the selected row: an error
        s.add((0, 2), np.array([last]), torch.randn(2, H, generator=torch.Generator().manual_seed(j)).bfloat16(),
              True)
        meta = {"req_id": f"r{j}", "prompt_len": P}
        if j == 3:
            meta["errors"] = ["steering at layer 9 failed"]
        if j == 4:
            meta["attn_heads"] = {"2": [0, 1]}
        reqs.append((s, meta, P))
    parts = [(dict(meta), s._tensors(None, pos_arrays=True)) for s, meta, _ in reqs]
    assert isinstance(parts[0][1]["g0-2.pos"], np.ndarray)
    for dtype in ("float32", "model"):
        alone = [build(s.to_bytes(meta), items, TABLE, request_id="x", prompt_token_ids=list(range(P)),
                       output_token_ids=[1], dtype=dtype) for s, meta, P in reqs]
        for target in (None, spill.spill_target(str(tmp_path))):
            buf = spill.open_entry(batch_to_wire(parts, target, {"rank": 0}))
            parsed = parse_batch(buf, dtype)
            assert [m["req_id"] for _, m in parsed] == [m["req_id"] for _, m, _ in reqs]
            assert parsed[4][1]["attn_heads"] == {"2": [0, 1]} and "errors" not in parsed[0][1]
            got = [build([(pts, meta, isinstance(buf, torch.Tensor))], items, TABLE, request_id="x",
                         prompt_token_ids=list(range(P)), output_token_ids=[1], dtype=dtype)
                   for (pts, meta), (_, _, P) in zip(parsed, reqs)]
            for a, b in zip(got, alone):
                _same(a, b)
            assert got[3].errors == ["steering at layer 9 failed"] and got[0].ok
            assert got[5].errors and not got[5].activations["resid_post"][0].numel()
            # Each request's rows are its own: writing them changes nobody else's.
            got[0].activations["resid_post"][0].mul_(0)
            assert torch.equal(got[1].activations["resid_post"][0], alone[1].activations["resid_post"][0])


def test_metadata_columns_round_trip():
    from vllm_hook.delivery.store import _columns, _metas

    metas = [{"req_id": "a", "prompt_len": 3}, {"req_id": "b", "prompt_len": 4, "errors": ["x"]},
             {"req_id": "c", "prompt_len": 5, "rank": 1, "attn_heads": {"1": [2]}}]
    cols = _columns(metas)
    assert set(cols["cols"]) == {"req_id", "prompt_len"} and set(cols["sparse"]) == {"1", "2"}
    assert _metas({"rows": cols}) == metas
    assert _metas({"rows": _columns([{"k": 1, "v": 2}] * 2)}) == [{"k": 1, "v": 2}] * 2
    assert _metas({"rows": _columns([{}, {}])}) == [{}, {}]


def test_safetensors_bytes_load_as_safetensors_loads_them():
    """`st_tensors` (numpy views of one copy) gives what `safetensors.torch.load` gives, for
    every dtype, empty, scalar and unaligned tensors; writable, and bfloat16 / float16 widened
    to float32 exactly where asked, from read-only bytes and from writable memory."""
    from safetensors.torch import load, save

    from vllm_hook.delivery.store import st_tensors

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=g).bfloat16(), "b": torch.randn(7, generator=g).half(),
               "c": torch.randn(2, 3, generator=g), "d": torch.arange(5), "e": torch.tensor(True),
               "f": torch.zeros(0, 4).bfloat16(), "g": torch.arange(3, dtype=torch.int32),
               "h": torch.randn(4, generator=g).double(), "i": torch.arange(9, dtype=torch.uint8),
               "j": torch.tensor(2.5)}
    blob = save(tensors, metadata={"k": "v"})
    ref = load(blob)
    got, meta = st_tensors(blob)
    assert meta == {"k": "v"} and set(got) == set(ref)
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    got["a"].mul_(2)                                  # writable, and nobody else's
    assert torch.equal(load(blob)["a"], ref["a"])
    # read-only bytes and writable memory alike
    for src in (blob, memoryview(bytearray(blob))):
        wide, _ = st_tensors(src, lambda m, name: name in ("a", "b", "f"))
        for k in ("a", "b", "f"):
            assert wide[k].dtype == torch.float32 and torch.equal(wide[k], ref[k].float())
    assert wide["c"].dtype == torch.float32 and wide["d"].dtype == torch.int64


def test_large_widened_results_are_exact_in_reused_memory_of_their_own_size(monkeypatch):
    """A served result's widened rows (`st_tensors`, 6 MiB of float32 here) come in reused,
    huge-page backed memory (`host_empty`): exact, the storage of the result's block alone
    (a pickle of one layer is not the mapping's 8 MiB), torch's thread count untouched, and
    the memory reused for the next result once the first is dropped."""
    import pickle

    from safetensors.torch import save

    from vllm_hook.delivery import hostmem
    from vllm_hook.delivery.store import st_tensors

    monkeypatch.setattr(hostmem, "RECYCLER", hostmem.Recycler(keep=64 << 20))
    g = torch.Generator().manual_seed(0)
    rows = {f"resid_post.{i}": torch.randn(256, 1536, generator=g).bfloat16() for i in range(4)}
    blob = memoryview(bytearray(save({**rows, "pos": torch.arange(256)})))
    threads = torch.get_num_threads()
    got, _ = st_tensors(blob, lambda m, name: name != "pos")
    assert torch.get_num_threads() == threads
    for k, t in rows.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], t.float()), k
    block = got["resid_post.0"].untyped_storage()
    assert block.nbytes() == 4 * 256 * 1536 * 4
    assert len(pickle.dumps(got["resid_post.0"])) < block.nbytes() + (1 << 20)
    ptr = block.data_ptr()
    del got, block
    again, _ = st_tensors(blob, lambda m, name: name != "pos")
    assert again["resid_post.0"].untyped_storage().data_ptr() == ptr     # reused
    assert all(torch.equal(again[k], t.float()) for k, t in rows.items())


def test_st_parts_are_the_safetensors_bytes_of_their_tensors(tmp_path):
    """`StParts` (a large served result a client reads from its file): written to a file, or
    joined, they are safetensors bytes that `safetensors.torch.load`
    and `st_tensors` read as the tensors and metadata given, every dtype, empty and scalar
    tensors included, each tensor's data aligned to its dtype (widest first, as safetensors
    lays them out); a `Chunked` tensor is written whole, a `Stacked` one part by part."""
    import os

    from safetensors.torch import load

    from vllm_hook.delivery.hostmem import Chunked
    from vllm_hook.delivery.store import Stacked, StParts, st_tensors

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 4, generator=g).bfloat16()
    tensors = {"a": torch.randn(3, 5, generator=g).bfloat16(), "b": torch.randn(7, generator=g).half(),
               "g": torch.arange(3, dtype=torch.int32), "c": torch.randn(2, 3, generator=g),
               "e": torch.tensor(True), "f": torch.zeros(0, 4).bfloat16(), "d": torch.arange(5),
               "i": torch.arange(9, dtype=torch.uint8), "j": torch.tensor(2.5),
               "h": torch.randn(4, 6, generator=g).double()[:, ::2],          # not contiguous
               "k": Chunked([torch.arange(6.0).view(2, 3, 1), torch.arange(4.0).view(2, 2, 1)]),
               "l": Stacked([rows[6:8], rows[0:2], rows[3:5].t().contiguous().t()])}   # the last strided
    parts = StParts(tensors, {"m": "v"})
    blob = parts.to_bytes()
    assert len(blob) == len(parts)
    ref = load(blob)
    got, meta = st_tensors(blob)
    assert meta == {"m": "v"} and set(ref) == set(got) == set(tensors)
    for k, t in tensors.items():
        want = torch.cat(t.parts, dim=1) if isinstance(t, Chunked) else torch.stack(t.parts) if isinstance(
            t, Stacked) else t
        assert torch.equal(ref[k], want) and torch.equal(got[k], want) and ref[k].dtype == want.dtype, k
    header_len = 8 + int.from_bytes(blob[:8], "little")
    from vllm_hook.delivery.store import _header
    for name, info in _header(blob)[0].items():
        if name != "__metadata__":
            assert (header_len + info["data_offsets"][0]) % ref[name].element_size() == 0, name
    fd = os.open(tmp_path / "r", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        parts.write(fd)
    finally:
        os.close(fd)
    assert (tmp_path / "r").read_bytes() == blob
    # a dtype safetensors names but this layout does not (a hook's uint32): `to_bytes` instead
    from vllm_hook.results import Results

    r = Results(request_id="x", prompt_len=1, token_ids=[1, 2])
    r.hook_results = [{"ids": torch.arange(3).to(torch.uint32)}]
    got = r.to_parts()
    assert isinstance(got, bytes) and torch.equal(Results.from_bytes(got).hook_results[0]["ids"], torch.arange(3).to(torch.uint32))


def test_a_served_results_stacked_layers_are_written_from_their_rows(tmp_path, monkeypatch):
    """A served result's layers of a site, blocks of the fetch's payload apart from one
    another (layer by layer, every request's rows in turn), are written to its file straight
    from those blocks (`Stacked`: no stacked copy first); the file holds what `to_bytes`
    holds, read back the same, as do the API server's encodings of it (inline on the event
    loop or an encoding thread, as a file below the inline bound); with a hook result of a
    dtype the layout lacks, `to_bytes`."""
    import os

    from vllm_hook.delivery.store import Stacked, StParts
    from vllm_hook.results import Results

    payload = torch.randn(4 * 3 * 5, 8).bfloat16()     # 4 layers x 3 requests x 5 rows
    r = Results(request_id="a", prompt_len=2, token_ids=list(range(5)), model="m")
    pos = torch.arange(5)
    for i, layer in enumerate((1, 3, 5, 7)):
        r.activations.setdefault("resid_post", {})[layer] = payload[i * 15 + 5:i * 15 + 10]   # request 1's
        r.positions.setdefault("resid_post", {})[layer] = pos
    parts = r.to_parts(stacked=True)
    assert isinstance(parts, StParts)
    kept = [p for p, _ in parts.parts if p.numel() == 5 * 8 * 2]
    assert [p.data_ptr() for p in kept] == [r.activations["resid_post"][x].data_ptr() for x in (1, 3, 5, 7)]
    fd = os.open(tmp_path / "r", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        parts.write(fd)
    finally:
        os.close(fd)
    for blob in ((tmp_path / "r").read_bytes(), parts.to_bytes(), r.to_bytes(stacked=True)):
        back = Results.from_bytes(blob)
        assert back.token_ids == r.token_ids
        for x in (1, 3, 5, 7):
            assert torch.equal(back.activations["resid_post"][x], r.activations["resid_post"][x])
            assert torch.equal(back.positions["resid_post"][x], pos)
    assert isinstance(r._payload(stacked=True, lazy=True)[0]["resid_post.*"], Stacked)
    # The API server's encoding: inline, on the event loop or an encoding thread (joined from
    # the parts there); kept as a file from the parts, however small the inline bound
    import base64

    from vllm_hook.config import HookConfig
    from vllm_hook.server import encode
    from vllm_hook.server.store import ResultStore

    cfg = HookConfig()
    store = ResultStore(cfg.max_retained_bytes, cfg.result_ttl_s, local_dir=str(tmp_path))
    stacks = []
    stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or stack(*a, **k))
    blobs = [base64.b64decode(encode.encode_one(r, 0, store, cfg, stacked=True)["data"])]
    assert stacks == [1]                   # on the event loop: `to_bytes`, as before
    blobs.append(base64.b64decode(encode.encode_one(r, 0, store, cfg, stacked=True, threaded=True)["data"]))
    small = HookConfig(max_inline_result_bytes=100, local_results=True)
    entry = encode.encode_one(r, 0, store, small, stacked=True, local=True)
    blobs.append(open(entry["local"], "rb").read())
    assert stacks == [1]                   # on an encoding thread and into a file: no torch copy
    monkeypatch.undo()
    for blob in blobs:
        back = Results.from_bytes(blob)
        assert all(torch.equal(back.activations["resid_post"][x], r.activations["resid_post"][x]) for x in (1, 3, 5, 7))
    r.hook_results = [{"ids": torch.arange(3).to(torch.uint32)}]
    back = Results.from_bytes(r.to_parts(stacked=True))
    assert torch.equal(back.activations["resid_post"][5], r.activations["resid_post"][5])


def test_a_fetched_payload_nobody_reads_is_handed_back(tmp_path):
    """A served batch whose clients all went away before reading its payload (or a fetch
    whose reply could not be merged) leaves no result file behind: it is offered for reuse."""
    from vllm_hook.frontend.delivery import Opened, release

    def spilled() -> str:
        return spill.write_spilled({"x": torch.arange(1024, dtype=torch.float32)}, {}, str(tmp_path))

    def results_files() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(spill.FREE))

    payload = {"path": spilled()}
    opened = Opened().expect({"a": [{"payload": payload, "j": 0}], "b": [{"payload": payload, "j": 1}]})
    assert len(results_files()) == 1
    del opened                                     # the batch dropped unread
    assert results_files() == []
    assert len(list(tmp_path.iterdir())) == 1      # kept for reuse, as a read one is
    release([{"batch": {"path": spilled()}}, {"batch": {"blob": b""}}, None])
    assert results_files() == []


@pytest.mark.parametrize("n,wire,model_dtype", [(1, True, "bfloat16"), (2, True, "bfloat16"),
                                                (1, False, "bfloat16"), (1, True, "float32"),
                                                (0, True, "bfloat16")])
def test_a_steering_only_result_is_the_one_build_makes(n, wire, model_dtype):
    """Steering-only results skip `build` (`_tokens_only`, served and offline): the same
    Results as the general path (`_built`), and the same when they travel (safetensors
    metadata has no fixed order: compared once read back)."""
    from types import SimpleNamespace

    from vllm_hook.frontend import delivery as D
    from vllm_hook.results import Results

    st = SimpleNamespace(info=SimpleNamespace(name="m", dtype=model_dtype, head_dim=16), points=TABLE,
                         timing={"read_s": 0.0, "build_s": 0.0})
    res = SimpleNamespace(items=[], hooks=0, fetches=False, save_dir=None, dtype="float32")
    outs = [SimpleNamespace(index=i, token_ids=[7 + i, 8, 9]) for i in range(n)]
    out = SimpleNamespace(request_id="cmpl-a-0", prompt_token_ids=[1, 2, 3, 4], outputs=outs)
    fast = D._tokens_only(st, out, res, wire)
    slow = D._built(st, out, [], res, None, wire)
    assert D._results_for(st, out, [], res, None, wire) == fast
    for a, b in zip(*(x if isinstance(x, list) else [x] for x in (fast, slow)), strict=True):
        assert a == b and Results.from_bytes(a.to_bytes()) == Results.from_bytes(b.to_bytes())
    assert isinstance(fast, list) == (n > 1)


def test_safetensors_header_read_by_msgspec_or_the_standard_library():
    """`store._header`: what msgspec reads equals json.loads's; a header msgspec refuses (NaN,
    which only a hand-made file holds) is read by the standard library."""
    import json
    import struct

    from vllm_hook.delivery.store import _header, st_tensors

    def blob(text: str) -> bytes:
        head = text.encode()
        return struct.pack("<Q", len(head)) + head + struct.pack("<f", 1.5)

    text = '{"__metadata__":{"k":"v"},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    assert _header(blob(text)) == (json.loads(text), 8 + len(text))
    tensors, meta = st_tensors(blob(text))
    assert meta == {"k": "v"} and tensors["x"].tolist() == [1.5]
    odd = text[:-1] + ',"y":NaN}'
    got, at = _header(blob(odd))
    assert at == 8 + len(odd) and got["x"] == json.loads(text)["x"] and got["y"] != got["y"]


def test_a_dropped_store_returns_its_bytes_to_the_budget():
    """A store's bytes go back to the worker's in-flight budget when it is dropped, however
    they came and went (its finalizer is made with its first bytes, not at admission)."""
    import gc

    from vllm_hook.delivery.store import Budget

    budget = Budget(1 << 20)
    never = RequestStore(budget)                  # steering only: holds nothing, ever
    s = RequestStore(budget)
    rows = torch.zeros(2, H, dtype=torch.bfloat16)
    s.add((0,), np.array([0, 1]), rows, True)
    for p in (2, 3, 4):                           # "last" keeps the two newest chunks
        s.add((0,), np.array([p, p + 1]), rows, True)
    assert budget.used == s.nbytes == 2 * rows.numel() * rows.element_size()
    assert s._finalized and not never._finalized       # made with the first bytes only
    refused = RequestStore(Budget(1))
    assert not refused.add((0,), np.array([0, 1]), rows, False) and not refused._finalized
    del s, never
    gc.collect()
    assert budget.used == 0


def test_a_step_goes_to_the_host_in_float32_when_every_owner_in_its_block_takes_it_so():
    """`Collector._wide_pools`: a block whose every segment's owner takes float32 rows (wire
    "W") reaches the host widened (the device's conversion: the same values as the host's);
    one shared with an owner in the model's dtype stays in it. A store keeps chunks of both
    dtypes as they came and joins them in its first chunk's (bf16 -> float32 -> bf16 is exact)
    only when fetched (rows handed over early are read once their copies are done), and the
    payload's parse lends float32 rows as they are (fresh, no copy) in a bf16 or fp16 model."""
    import gc
    from types import SimpleNamespace

    from vllm_hook.delivery import arena as A
    from vllm_hook.delivery.collector import Collector
    from vllm_hook.delivery.store import NotLent
    from vllm_hook.routing import Segment, StepRouting

    pool = torch.randn(4096, 64).bfloat16()
    wide, narrow = SimpleNamespace(widen=True), SimpleNamespace(widen=False)
    got = []
    c = Collector([pool], lambda seg, rows: got.append((seg.owner, rows)), arena_bytes=1 << 20,
                  widens=lambda owner: owner.widen)

    def step(owners):
        got.clear()
        segs = [Segment(owner=o, points=(0, 1), pool_start=300 * i, positions=np.arange(150), last_only=False)
                for i, o in enumerate(owners)]
        c.after_forward(StepRouting(segments=segs, pool_used={0: 300 * len(owners)}))
        return [rows for _, rows in got]

    rows = step([wide, wide])
    assert [r.dtype for r in rows] == [torch.float32] * 2 and c.arena.holds(rows[0])
    assert torch.equal(rows[1], pool[300:600].float())
    assert [r.dtype for r in step([wide, narrow])] == [torch.bfloat16] * 2
    del rows
    got.clear()

    s = RequestStore()
    s.add((0, 1), np.arange(2), pool[:4].float(), False)
    s.add((0, 1), np.arange(2, 3), pool[4:6], False)           # a later block not widened
    assert s.nbytes == 4 * 64 * 4 + 2 * 64 * 2                  # kept as they came: not read yet
    with pytest.raises(NotLent):                                # a reply made ahead would read them
        s.blocks(chunked=True, views_only=True)
    (_, pos, blocks), = s.blocks()
    assert blocks.dtype == torch.float32 and pos.tolist() == [0, 1, 2]
    assert torch.equal(blocks.reshape(-1, 64), torch.cat([pool[0:2], pool[4:5], pool[2:4], pool[5:6]]).float())

    a = A.Arena(1 << 20, torch.device("cpu"))
    front = A.FrontendArenas()
    front.adopt(a.offer())
    lent = a.alloc((2, 200, 64), torch.float32).normal_()
    wire = batch_to_wire([({"req_id": "0"}, {"g1-2": lent, "g1-2.pos": torch.arange(200)})], None, None, a)
    (pts, meta), = parse_batch(wire["blob"], "float32", front.views(wire["lent"]), lend_float32=True)
    assert meta["_fresh"] == {1, 2} and meta["_owned"] and torch.equal(pts[2][1], lent[1])
    lent[1, 0, 0] = 42.0
    assert pts[2][1][0, 0] == 42.0                              # the arena's rows, not a copy
    (pts, _), = parse_batch(wire["blob"], "float32", front.views(wire["lent"]))    # a float32 model's
    lent[1, 0, 0] = 7.0
    assert pts[2][1][0, 0] == 42.0                              # copied
    del pts, meta, lent, wire
    gc.collect()
    assert a.stats()["arena_used_bytes"] == 0


def test_a_large_block_to_widen_goes_in_the_model_dtype_where_the_arena_has_no_room(monkeypatch):
    """`Collector._to_host`: a block to widen is widened where the arena takes it in float32,
    or where it is small (WIDEN_OUTSIDE_ARENA_BYTES); a larger one the arena has no room for
    goes in the model's dtype (its frontend widens it), in the arena if it fits so. Never where
    float32 rows would pass the in-flight budget (`room`)."""
    from types import SimpleNamespace

    from vllm_hook.delivery import collector as C
    from vllm_hook.delivery.arena import MIN_BLOCK_BYTES
    from vllm_hook.routing import Segment, StepRouting

    monkeypatch.setattr(C, "WIDEN_OUTSIDE_ARENA_BYTES", 300 * 64 * 4)
    assert 300 * 64 * 4 >= MIN_BLOCK_BYTES                 # the arena is offered to every step below
    pool = torch.randn(4096, 64).bfloat16()
    wide = SimpleNamespace()
    got, budget = [], {"room": True}
    c = C.Collector([pool], lambda seg, rows: got.append(rows), arena_bytes=1 << 20, widens=lambda owner: True,
                    room=lambda n: budget["room"])

    def step(n):
        got.clear()
        seg = Segment(owner=wide, points=(0,), pool_start=0, positions=np.arange(n), last_only=False)
        c.after_forward(StepRouting(segments=[seg], pool_used={0: n}))
        rows, = got
        assert torch.equal(rows.float(), pool[:n].float())
        return rows

    held = [step(1024)]                     # 256 KiB in float32: the arena has room
    assert held[0].dtype == torch.float32 and c.arena.holds(held[0]) and c.widened == 1
    budget["room"] = False
    assert step(1024).dtype == torch.bfloat16 and c.widened == 1      # the budget says no
    budget["room"] = True
    got.clear()
    for rows in (1024, 16):                 # the arena filled up
        while (t := c.arena.alloc((rows, 64), torch.float32)) is not None:
            held.append(t)
    del held[1]                             # but for a hole of 256 - 120 KiB: 1024 rows fit in bf16 only
    held.append(c.arena.alloc((480, 64), torch.float32))
    big = step(1024)                        # no room in float32: above the cap outside it
    assert big.dtype == torch.bfloat16 and c.arena.holds(big) and c.widened == 1
    small = step(300)                       # at the cap: widened outside the arena
    assert small.dtype == torch.float32 and not c.arena.holds(small) and c.widened == 2


def test_rows_handed_over_early_are_joined_across_dtypes_only_once_copied(monkeypatch):
    """A prompt split over two steps, its first block widened and its last shared with a
    request in the model's dtype: its last rows are handed to its store before their copy
    completes (`Collector.hand_over_early`). The join of its two dtypes reads them only at the
    fetch, after the copies (`settle`): no row read before it was written."""
    from vllm_hook.delivery import collector as C
    from vllm_hook.routing import Segment, StepRouting

    queued = []

    class Event:                  # a device's copy: the host sees NaN until it completes
        def record(self):
            self.copies, queued[:] = list(queued), []

        def query(self):
            return False

        def synchronize(self):
            for host, src in self.copies:
                host.copy_(src)

    def to_host(self, t, arena=None, dtype=None):
        host = arena.alloc(t.shape, dtype or t.dtype)
        queued.append((host, t.to(dtype or t.dtype)))
        return host.fill_(float("nan"))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(C.Collector, "_to_host", to_host)
    pool = torch.randn(1200, 64).bfloat16()
    class Owner:                  # hashable, as the worker's requests are
        def __init__(self, widen):
            self.widen, self.store = widen, RequestStore()

    a, b = Owner(True), Owner(False)
    c = C.Collector([pool], lambda seg, rows, blocked=False: seg.owner.store.add(
        seg.points, seg.positions, rows, seg.last_only, blocked), arena_bytes=1 << 20, widens=lambda o: o.widen)
    c.on_device = True
    want = pool[:600].float()
    c.after_forward(StepRouting(segments=[Segment(a, (0,), 0, np.arange(300), False)], pool_used={0: 300}))
    c.drain(wait=True)
    pool[:600] = pool[600:]
    want = torch.cat([want[:300], pool[:300].float()])
    c.after_forward(StepRouting(segments=[Segment(a, (0,), 0, np.arange(300, 600), False),
                                          Segment(b, (0,), 300, np.arange(300), False)], pool_used={0: 600}))
    assert c.hand_over_early({a})
    c.settle({a})
    (_, pos, rows), = a.store.blocks()
    assert rows.dtype == torch.float32 and pos.tolist() == list(range(600))
    assert torch.equal(rows[0], want)


def test_a_served_results_lent_rows_are_written_from_their_parts(tmp_path):
    """A served request's every-token rows, lent by the worker as a prompt block and decode
    runs (each run's rows strided: every point's row of a step together), stay those parts
    (`Chunked.row`: `hostmem.Rows`) and are written to the result's file piece by piece,
    strided rows through a buffer, never joined on the way (`byte_views`); the file,
    `to_bytes` (joined), the unstacked layout and the inline encodings read back as the joined
    rows; a prefix of them (`rows[:k]`) likewise; `build`'s general path joins them."""
    import base64
    import os

    from vllm_hook.config import HookConfig
    from vllm_hook.delivery import hostmem
    from vllm_hook.delivery.hostmem import Chunked, Rows
    from vllm_hook.delivery.store import StParts
    from vllm_hook.results import Results, _dense
    from vllm_hook.server import encode
    from vllm_hook.server.store import ResultStore

    g = torch.Generator().manual_seed(1)
    points, width = 3, 8
    prompt = torch.randn(points, 5, width, generator=g).bfloat16()
    runs = [torch.randn(n, points, width, generator=g).bfloat16() for n in (4, 2)]   # [steps, points, width]
    parts = [prompt, *(run.permute(1, 0, 2) for run in runs)]                        # [points, steps, width], strided
    c = Chunked(parts)
    want = torch.cat(parts, dim=1)
    pos = torch.arange(11)
    r = Results(request_id="a", prompt_len=5, token_ids=list(range(12)), model="m")
    for k, layer in enumerate((2, 4, 6)):
        r.activations.setdefault("resid_post", {})[layer] = c.row(k)
        r.positions.setdefault("resid_post", {})[layer] = pos
    assert isinstance(r.activations["resid_post"][4], Rows) and encode.result_nbytes(r) == want.numel() * 2
    keep = hostmem.SCRATCH_KEEP
    hostmem.SCRATCH_KEEP = 0                       # this thread keeps no buffer: a fresh one
    try:
        for stacked in (True, False):
            sp = r.to_parts(stacked=stacked)
            assert isinstance(sp, StParts) and any(not p.is_contiguous() for p, _ in sp.parts)
            fd = os.open(tmp_path / f"r{stacked}", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                sp.write(fd)
            finally:
                os.close(fd)
            assert c._joined is None                   # written from the parts
            for blob in ((tmp_path / f"r{stacked}").read_bytes(), sp.to_bytes()):
                back = Results.from_bytes(blob)
                for k, layer in enumerate((2, 4, 6)):
                    assert torch.equal(back.activations["resid_post"][layer], want[k]), (stacked, layer)
    finally:
        hostmem.SCRATCH_KEEP = keep
    # the API server's encodings: a file below the inline bound, inline on a thread or the loop
    cfg = HookConfig()
    store = ResultStore(cfg.max_retained_bytes, cfg.result_ttl_s, local_dir=str(tmp_path))
    small = HookConfig(max_inline_result_bytes=100, local_results=True)
    blobs = [open(encode.encode_one(r, 0, store, small, stacked=True, local=True)["local"], "rb").read(),
             base64.b64decode(encode.encode_one(r, 0, store, cfg, stacked=True, threaded=True)["data"])]
    assert c._joined is None
    blobs.append(base64.b64decode(encode.encode_one(r, 0, store, cfg, stacked=True)["data"]))
    for blob in blobs:
        back = Results.from_bytes(blob)
        assert all(torch.equal(back.activations["resid_post"][L], want[k]) for k, L in enumerate((2, 4, 6)))
    # a prefix stays parts; anything else joins the whole block once
    head = c.row(1)[:7]
    assert isinstance(head, Rows) and torch.equal(hostmem.as_tensor(head), want[1, :7])
    assert torch.equal(c.row(2)[torch.tensor([0, 9])], want[2, [0, 9]])
    assert torch.equal(r.stacked("resid_post"), want)
    pts = {0: (pos, c.row(0)), 1: (pos, want[1])}
    dense = _dense((pts, {}, True))[0]
    assert all(isinstance(rows, torch.Tensor) for _, rows in dense.values()) and torch.equal(dense[0][1], want[0])
