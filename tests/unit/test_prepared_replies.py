"""Fetch replies made while the step that ends their requests runs (`worker.prepared`): a fetch
of exactly those requests gets the same results, bit for bit, as one answered at the fetch;
any other fetch, or a request changed since, gets the reply made at the fetch; rows outside
the arena are never read early (`lend_only`), and nothing stays lent from a dropped reply."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import torch

from vllm_hook.adapters.base import NewRequest, SchedulerEvents, StepView
from vllm_hook.config import HookConfig
from vllm_hook.delivery.arena import FRONTEND as ARENAS
from vllm_hook.delivery.store import NotLent, RequestStore, batch_to_wire
from vllm_hook.frontend.delivery import Opened, merge_ranks
from vllm_hook.model.buffers import BufferShape, HookBuffers
from vllm_hook.model.layout import PointTable
from vllm_hook.spec import ModelInfo
from vllm_hook.spec.resolve import resolve
from vllm_hook.spec.schema import parse_spec
from vllm_hook.worker.runtime import HookRuntime

L, H, P, N = 4, 512, 10, 64          # a step's block: 64 x 2 x 512 bf16 = 128 KiB, in the arena
CFG = HookConfig(capture_pool_rows=4096, result_arena_bytes=64 << 20)
INFO = ModelInfo(num_layers=L, hidden_size=H, num_heads=8, num_kv_heads=2, head_dim=64, dtype="bfloat16")
SPEC = {"capture": [{"layers": [1, 3], "tokens": "last_prompt"}]}


def _worker() -> HookRuntime:
    points = PointTable.for_config(L, CFG)
    shape = BufferShape.for_engine(num_layers=L, hidden=H, max_num_batched_tokens=N * P, max_num_seqs=N,
                                   cfg=CFG, points=points)
    rt = HookRuntime(HookBuffers(shape, torch.bfloat16, torch.device("cpu")), points, CFG)
    ARENAS.adopt(rt.collector.arena.offer())
    return rt


def _admit(rt: HookRuntime, tag: str, spec=SPEC, **wire) -> list[str]:
    res = resolve(parse_spec(spec), INFO, CFG, P, lambda n: None, max_model_len=64)
    ids = [f"{tag}{i}" for i in range(N)]
    rt.on_events(SchedulerEvents(new=tuple(NewRequest(r, {**res.wire, **wire, "key": r}, P) for r in ids)))
    return ids


def _prefill(rt: HookRuntime, ids: list[str], seed: int) -> None:
    """One prefill step of `ids`, the pools holding fresh random rows as the forward wrote."""
    view = StepView(index={r: i for i, r in enumerate(ids)}, query_start_loc=np.arange(len(ids) + 1, dtype=np.int32) * P,
                    num_computed=np.zeros(len(ids), dtype=np.int32), num_tokens=len(ids) * P,
                    num_tokens_padded=len(ids) * P)
    rt.begin_step(view)
    g = torch.Generator().manual_seed(seed)
    for pool in rt.bufs.pools:
        if pool is not None:
            pool.copy_(torch.randn(pool.shape, generator=g).to(pool.dtype))
    rt.end_step()


def _results(reply: dict) -> dict[str, tuple]:
    opened = Opened()
    out = {}
    for key, entries in merge_ranks([reply]).items():
        (e,) = entries
        points, meta, _ = opened.part(e, "float32")
        out[key] = ({p: (pos.clone(), rows.clone()) for p, (pos, rows) in points.items()}, meta.get("errors"))
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][1] == b[k][1]
        assert a[k][0].keys() == b[k][0].keys()
        for p in a[k][0]:
            assert torch.equal(a[k][0][p][0], b[k][0][p][0]) and torch.equal(a[k][0][p][1], b[k][0][p][1])


def _lent(rt: HookRuntime) -> int:
    return len(rt.collector.arena._lent)


def test_prepared_reply_equals_the_reply_made_at_the_fetch():
    rt = _worker()
    arenas = ARENAS.tokens()
    rt.fetch([], None, arenas)                     # the frontend has mapped the arena: lent from now on
    a, b = _admit(rt, "a"), _admit(rt, "b")
    _prefill(rt, a, seed=1)
    assert rt.prepared.made == 1 and len(rt.prepared) == 1
    early = _results(rt.fetch(a, None, arenas))
    assert rt.prepared.used == 1 and not rt.prepared
    rt._lent_to = ()                              # `b` not prepared (the frontend seems not to map it)
    _prefill(rt, b, seed=1)
    assert rt.prepared.made == 1
    late = _results(rt.fetch(b, None, arenas))
    rename = {f"b{i}": f"a{i}" for i in range(N)}
    _same(early, {rename[k]: v for k, v in late.items()})
    assert all(len(pts) == 2 for pts, _ in early.values())
    gc.collect()
    rt.collector.arena.reclaim()
    assert _lent(rt) == 0                         # every piece lent by either reply back


def test_a_fetch_of_several_steps_takes_each_steps_prepared_reply_and_answers_the_rest():
    """Prompts prefilled in several steps: a reply per step; one fetch of all of them carries
    each prepared reply and a payload made at the fetch for requests none covers."""
    rt = _worker()
    arenas = ARENAS.tokens()
    rt.fetch([], None, arenas)
    ids, more = _admit(rt, "m"), _admit(rt, "x")
    _prefill(rt, ids[:32], seed=6)
    _prefill(rt, ids[32:], seed=7)
    rt._lent_to = ()
    _prefill(rt, more, seed=8)                     # not prepared
    assert rt.prepared.made == 2
    reply = rt.fetch(ids + more, None, arenas)
    assert rt.prepared.used == 2 and len(reply["more"]) == 2 and len(reply["entries"]) == N
    got = _results(reply)
    ref = _worker()
    ref.fetch([], None, arenas)
    rids, rmore = _admit(ref, "m"), _admit(ref, "x")
    ref._lent_to = ()
    for part, seed in ((rids[:32], 6), (rids[32:], 7), (rmore, 8)):
        _prefill(ref, part, seed=seed)
    assert ref.prepared.made == 0
    rids += rmore
    _same(got, _results(ref.fetch(rids, None, arenas)))


def test_other_fetches_and_changed_requests_get_a_reply_made_at_the_fetch():
    rt = _worker()
    arenas = ARENAS.tokens()
    rt.fetch([], None, arenas)
    ids = _admit(rt, "c")
    _prefill(rt, ids, seed=2)
    assert len(rt.prepared) == 1 and _lent(rt) > 0
    # A fetch of some of them: the prepared reply is dropped, its pieces taken back.
    half = _results(rt.fetch(ids[:8], None, arenas))
    assert rt.prepared.used == 0 and rt.prepared.dropped == 1 and not rt.prepared
    assert len(half) == 8 and all(len(pts) == 2 for pts, _ in half.values())
    # An error noted after the reply was made: the reply made at the fetch carries it.
    ids = _admit(rt, "d")
    _prefill(rt, ids, seed=3)
    rt.requests.get(ids[5], rt.done.get(ids[5])).errors.append("noted late")
    got = _results(rt.fetch(ids, None, arenas))
    assert rt.prepared.used == 0 and got[ids[5]][1] == ["noted late"] and got[ids[4]][1] is None
    # Aborted: discarded with the results.
    ids = _admit(rt, "e")
    _prefill(rt, ids, seed=4)
    assert len(rt.prepared) == 1
    rt.discard(ids)
    assert not rt.prepared and rt.prepared.dropped == 3
    gc.collect()
    rt.collector.arena.reclaim()
    assert _lent(rt) == 0                         # dropped replies' pieces taken back


def test_requests_that_read_generated_tokens_are_not_prepared():
    rt = _worker()
    arenas = ARENAS.tokens()
    rt.fetch([], None, arenas)
    ids = _admit(rt, "f", {"capture": [{"layers": [1], "tokens": "all"}]})
    _prefill(rt, ids, seed=5)
    assert rt.prepared.made == 0              # routed beyond the prompt: not done at this step
    got = _results(rt.fetch(ids, None, arenas))
    assert all(len(pts) == 1 for pts, _ in got.values())


def test_all_token_captures_of_one_token_requests_end_at_their_prompt(monkeypatch):
    """max_tokens (the wire's "M") bounds open-ended routes: a request generating one token
    forwards its prompt only, so its every-token capture is whole after its prefill step and
    is prepared, equal to the reply made at the fetch; with two tokens it routes one more.
    16 prompts of 40 tokens: each request's rows (160 KiB) are lent on their own."""
    monkeypatch.setattr(sys.modules[__name__], "P", 40)
    monkeypatch.setattr(sys.modules[__name__], "N", 16)
    spec = {"capture": [{"layers": [0, 1, 2, 3], "tokens": "all"}]}
    rt = _worker()
    arenas = ARENAS.tokens()
    rt.fetch([], None, arenas)
    ids = _admit(rt, "o", spec, M=1)
    assert all(rt.requests[r].horizon == 39 for r in ids)
    _prefill(rt, ids, seed=9)
    assert rt.prepared.made == 1 and not rt.active
    early = _results(rt.fetch(ids, None, arenas))
    assert rt.prepared.used == 1
    rt._lent_to = ()
    late_ids = _admit(rt, "q", spec, M=1)
    _prefill(rt, late_ids, seed=9)
    late = _results(rt.fetch(late_ids, None, arenas))
    _same(early, {f"o{k[1:]}": v for k, v in late.items()})
    assert all(len(pts) == 4 and all(len(pos) == 40 for pos, _ in pts.values()) for pts, _ in early.values())
    two = _admit(rt, "t", spec, M=2)
    assert all(rt.requests[r].horizon == 40 for r in two) and set(two) <= set(rt.active)
    # rows of decode steps are not lent from the arena: no reply is tried for such requests
    _prefill(rt, two, seed=3)
    tried = []
    rt._reply = lambda *a, **k: tried.append(a)
    rt.begin_step(StepView(index={r: i for i, r in enumerate(two)}, query_start_loc=np.arange(len(two) + 1, dtype=np.int32),
                           num_computed=np.full(len(two), 40, dtype=np.int32), num_tokens=len(two),
                           num_tokens_padded=len(two)))
    rt.end_step()
    assert not rt.active and not tried


def test_lend_only_never_sends_rows_by_value():
    s = RequestStore()
    s.add((0,), np.arange(3), torch.randn(3, 8).bfloat16(), False)
    parts = [({"req_id": "r"}, s._tensors(pos_arrays=True))]
    with pytest.raises(NotLent):
        batch_to_wire(parts, None, None, None, lend_only=True)
    assert "blob" in batch_to_wire(parts, None)


def test_collector_hands_arena_rows_over_early_and_still_waits_for_their_copies():
    """`Collector.hand_over_early`: the rows of the requests ending (`a`) in steps in flight
    that lie in the arena are handed to their stores at once, oldest step first (views, not
    read), then waited for by `settle` and not handed over again; other requests' rows of
    those steps (`b`) are handed over as before, in order; a step outside the arena holding
    rows of theirs: False, nothing handed over."""
    from vllm_hook.delivery.arena import Arena
    from vllm_hook.delivery.collector import Collector
    from vllm_hook.routing import Segment

    class Event:
        def __init__(self):
            self.done = self.waited = False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

    delivered = []
    col = Collector([torch.zeros(8, 4)], lambda seg, rows, blocked=False: delivered.append((seg.owner, seg.pool_start, rows)))
    col.on_device, col.arena = True, Arena(1 << 20, torch.device("cpu"))
    a, b, c = "a", "b", "c"

    def seg(owner, start):
        return Segment(owner, (0,), start, np.array([0]), False)

    older, newer = col.arena.alloc((3, 4), torch.float32), col.arena.alloc((3, 4), torch.float32)
    ev1, ev2 = Event(), Event()
    col._pending.append((ev1, {0: older}, [seg(a, 0), seg(b, 1)], [], []))
    col._pending.append((ev2, {0: newer}, [seg(b, 0), seg(a, 1)], [], []))
    assert col.hand_over_early({a})
    assert [(o, s) for o, s, _ in delivered] == [(a, 0), (a, 1)] and not ev1.waited and not ev2.waited
    assert delivered[1][2].data_ptr() == newer[1:2].data_ptr()          # a view: nothing read
    col.settle({a})
    assert ev1.waited and ev2.waited and col.in_flight == 0
    assert [(o, s) for o, s, _ in delivered] == [(a, 0), (a, 1), (b, 1), (b, 0)]     # b: as before, in order
    ev3 = Event()
    col._pending.append((ev3, {0: torch.zeros(3, 4)}, [seg(c, 0)], [], []))
    assert not col.hand_over_early({c}) and len(delivered) == 4
    col.settle({c})
    assert ev3.waited and delivered[-1][0] == c


# ---- the device's copies emulated: a step's host rows read NaN until its event completes ----
@pytest.fixture
def device(monkeypatch):
    """Collectors made after this see their copies complete only when their step's event is
    waited for or queried done: a row read before that is NaN in the results."""
    from vllm_hook.delivery import collector as C

    queued: list = []

    class Event:
        def __init__(self):
            self.copies, self.done = [], False

        def record(self):
            self.copies, queued[:] = list(queued), []

        def query(self):
            return self.done

        def synchronize(self):
            if not self.done:
                for host, src in self.copies:
                    host.copy_(src)
                self.done = True

    original = C.Collector._to_host

    def to_host(self, t, arena=None, dtype=None):
        if not self.on_device:                    # a reference worker: copies at once
            return original(self, t, arena, dtype)
        dtype = dtype or t.dtype
        host = arena.alloc(t.shape, dtype) if arena is not None else None
        if host is None:
            host = torch.empty(t.shape, dtype=dtype)
        host.fill_(float("nan"))
        queued.append((host, t.to(dtype)))
        return host

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(C.Collector, "_to_host", to_host)

    def make():
        rt = _worker()
        rt.collector.on_device = True
        rt.fetch([], None, ARENAS.tokens())
        return rt
    return make


def _reference(tag: str, steps) -> dict:
    """The results of the same steps on a worker that prepares nothing (copies at once)."""
    ref = _worker()
    ref.fetch([], None, ARENAS.tokens())
    ids = _admit(ref, tag)
    ref._lent_to = ()
    for step in steps:
        step(ref, ids)
    return _results(ref.fetch(ids, None, ARENAS.tokens()))


def _nan(res: dict) -> bool:
    return any(torch.isnan(rows).any().item() for pts, _ in res.values() for _, rows in pts.values())


def test_a_reply_made_while_the_copies_run_reads_no_row_before_they_complete(device):
    rt = device()
    ids = _admit(rt, "g")
    _prefill(rt, ids, seed=9)
    assert rt.prepared.made == 1 and rt.collector.in_flight == 1 and not rt.collector._pending[0][0].done
    got = _results(rt.fetch(ids, None, ARENAS.tokens()))
    assert rt.prepared.used == 1 and not _nan(got)
    _same(got, _reference("g", [lambda w, i: _prefill(w, i, seed=9)]))


def test_rows_routed_after_the_reply_was_made_make_it_stale(device):
    """Preempted after its prompt's step and recomputed, its new rows still in flight at the
    fetch (not handed over early): the reply made at the first step is not used; the results
    hold the newest rows."""
    def steps(w, ids):
        _prefill(w, ids, seed=10)
        w.on_events(SchedulerEvents(resumed=frozenset(ids)))
        lent, w._lent_to = w._lent_to, ()
        _prefill(w, ids, seed=11)
        w._lent_to = lent
    rt = device()
    ids = _admit(rt, "h")
    steps(rt, ids)
    assert rt.prepared.made == 1
    got = _results(rt.fetch(ids, None, ARENAS.tokens()))
    assert rt.prepared.used == 0 and not _nan(got)
    _same(got, _reference("h", [steps]))


def test_a_reply_is_dropped_for_a_frontend_without_the_arena_and_when_its_results_expire(device):
    rt = device()
    ids = _admit(rt, "k")
    _prefill(rt, ids, seed=12)
    assert len(rt.prepared) == 1
    got = _results(rt.fetch(ids, None, []))       # a frontend that has not mapped the arena
    assert rt.prepared.used == 0 and not rt.prepared and not _nan(got) and len(got) == N
    ids = _admit(rt, "l")
    _prefill(rt, ids, seed=13)
    rt.on_events(SchedulerEvents(finished=frozenset(ids)))
    for rid in ids:
        rt.done[rid].finished_at -= 10 * CFG.result_ttl_s
    rt._expire()
    assert not rt.done and not rt.prepared
    gc.collect()
    rt.collector.arena.reclaim()
    assert _lent(rt) == 0 and rt.budget.used == 0


def test_a_fetch_that_fails_after_taking_a_reply_gives_its_pieces_back(monkeypatch):
    rt = _worker()
    rt.fetch([], None, ARENAS.tokens())
    ids = _admit(rt, "n")
    more = _admit(rt, "o")
    _prefill(rt, ids, seed=14)
    rt._lent_to = ()
    _prefill(rt, more, seed=15)
    assert len(rt.prepared) == 1 and _lent(rt) > 0

    def fail(*a, **k):
        raise MemoryError("writing the payload")
    monkeypatch.setattr(rt, "_reply", fail)
    with pytest.raises(MemoryError):
        rt.fetch(ids + more, None, ARENAS.tokens())
    assert not rt.prepared and rt.prepared.dropped == 1
    gc.collect()
    rt.collector.arena.reclaim()
    assert _lent(rt) == 0
