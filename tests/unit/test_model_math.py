"""The in-model steering formula and capture scatter, against the documented formulas."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from vllm_hook.delivery.store import RequestStore, points_from_bytes
from vllm_hook.model.buffers import pack_op
from vllm_hook.model.steering import capture_rows, steer_delta


def tables(ops, H=16, K=2, slots=None):
    """ops: list of (coef5, vector); op i's unit vector is row i. Op i+1 holds u.u with the ops listed in slots[i] (earlier
    ops of the same row and layer), as the runtime computes it at admission."""
    n = len(ops)
    op_prm = torch.zeros(n + 1, 4 + K)
    op_prm[0, :5] = torch.tensor([0, 0, 0, -math.inf, math.inf])
    unit = torch.zeros(n + 1, H)
    for i, (_c, v) in enumerate(ops, 1):
        unit[i] = v / v.norm()
    for i, (c, v) in enumerate(ops, 1):
        gram = [float(unit[i] @ unit[j]) for j in (slots or {}).get(i, [])]
        op_prm[i] = torch.tensor([c[0] * float(v.norm()), *c[1:], *gram, *[0.0] * (K - 1 - len(gram))])
    return op_prm, unit


def packed(idx, op_vid):
    """op_idx entries as the runtime writes them: op row | vector row << 32."""
    return torch.tensor([[pack_op(o, int(op_vid[o])) for o in row] for row in idx], dtype=torch.int64)


def test_identity_is_exactly_zero():
    h = torch.randn(5, 16) * 100
    op_prm, unit = tables([])
    d = steer_delta(h, torch.zeros(8, 2, dtype=torch.int64), op_prm, unit, 2)
    assert torch.equal(d, torch.zeros_like(h))


def test_each_formula_and_order():
    torch.manual_seed(0)
    H = 16
    h = torch.randn(3, H, dtype=torch.float64).float()
    v1, v2 = torch.randn(H), torch.randn(H)
    u1, u2 = v1 / v1.norm(), v2 / v2.norm()
    inf = math.inf
    ops = [([2.0, 0, 0, -inf, inf], v1),      # add
           ([0, 0.5, 0, -inf, inf], v2),      # norm-matched add
           ([0, 0, 0, -0.1, 0.2], v1),        # cap
           ([0, 0, -1.0, -inf, inf], v2)]     # ablate (scale 0)
    op_prm, unit = tables(ops, H, slots={3: [1], 4: [2]})
    # Row 0: op1 then op3 at one layer; row 1: op2 then op4; row 2: nothing.
    # vector rows differ from op rows, as in the engine (vectors are shared between ops)
    op_vid = torch.tensor([0, 3, 1, 4, 2])
    unit = unit[torch.tensor([0, 2, 4, 1, 3])]
    idx = packed([[1, 3], [2, 4], [0, 0]] + [[0, 0]] * 5, op_vid)
    d = steer_delta(h, idx, op_prm, unit, 2)
    x = h[0] + 2.0 * v1
    p = x @ u1
    x = x + (p.clamp(-0.1, 0.2) - p) * u1
    assert torch.allclose(h[0] + d[0], x, atol=1e-5)
    y = h[1] + 0.5 * h[1].norm() * u2
    y = y - (y @ u2) * u2
    assert torch.allclose(h[1] + d[1], y, atol=1e-5)
    assert abs(float((h[1] + d[1]) @ u2)) < 1e-5
    assert torch.equal(d[2], torch.zeros(H))


def test_capture_rows_scatter():
    pool = torch.zeros(10, 4)
    x = torch.arange(12.0).view(3, 4)
    idx = torch.tensor([8, 0, 9, 9, 9])
    capture_rows(x, idx, pool)
    assert torch.equal(pool[0], x[1]) and torch.equal(pool[8], x[0])


def test_store_newest_copy_wins_and_roundtrip():
    s = RequestStore()
    s.add((0,), np.array([0, 1, 2]), torch.tensor([[0.0], [1.0], [2.0]]), last_only=False)
    s.add((0,), np.array([2, 3]), torch.tensor([[20.0], [3.0]]), last_only=False)   # recompute of 2
    pts, meta = points_from_bytes(s.to_bytes({"errors": ["x"]}))
    pos, rows = pts[0]
    assert pos.tolist() == [0, 1, 2, 3] and rows.flatten().tolist() == [0.0, 1.0, 20.0, 3.0]
    assert meta == {"errors": ["x"]}


def test_store_falls_back_to_the_rpc_when_the_spill_fails(tmp_path, monkeypatch):
    import os

    from vllm_hook.delivery import spill

    def full(fd, offset, size):
        raise OSError(28, "No space left on device")          # a container's 64 MiB /dev/shm

    monkeypatch.setattr(spill.os, "posix_fallocate", full)
    s = RequestStore()
    s.add((0,), np.arange(3), torch.ones(3, 4), last_only=False)
    target = spill.spill_target(str(tmp_path))
    wire = s.to_wire({}, target)
    assert set(wire) == {"blob"} and os.listdir(tmp_path) == [target["probe"]]   # no partial file
    assert points_from_bytes(spill.open_entry(wire))[0][0][1].shape == (3, 4)


def _spilled(tmp_path):
    return sorted(f for f in os.listdir(tmp_path) if "probe" not in f)


def test_store_spills_to_a_shared_file_on_the_same_host_only(tmp_path):
    from safetensors.torch import load_file

    from vllm_hook.delivery.spill import open_entry, spill_target, sweep_spilled

    s = RequestStore()
    rows = torch.arange(120, dtype=torch.float32).reshape(60, 2).to(torch.bfloat16)
    s.add((3, 5), np.arange(30), rows, last_only=False)
    target = spill_target(str(tmp_path))
    wire = s.to_wire({"rank": 0}, target)
    assert set(wire) == {"path"} and os.path.dirname(wire["path"]) == str(tmp_path)
    assert set(load_file(wire["path"])) == {"g3-5", "g3-5.pos"}   # plain safetensors: rows of points 3 and 5
    buf = open_entry(wire)                       # read into private memory, file handed back
    (free,) = _spilled(tmp_path)
    assert free.startswith("vllm_hook-free-")
    capacity = os.path.getsize(tmp_path / free)
    pts, meta = points_from_bytes(buf)
    assert meta == {"rank": 0} and pts[3][0].tolist() == list(range(30))
    assert torch.equal(pts[3][1], rows[:30]) and torch.equal(pts[5][1], rows[30:])
    assert pts[5][1].dtype == torch.bfloat16
    # A smaller result reuses the file (same size: a pad tensor fills the tail); what the
    # frontend read before is its own memory, untouched.
    small = RequestStore()
    small.add((1,), np.array([7]), torch.ones(1, 2), last_only=False)
    wire = small.to_wire({}, target)
    assert _spilled(tmp_path) == [os.path.basename(wire["path"])]
    assert os.path.getsize(wire["path"]) == capacity
    assert set(load_file(wire["path"])) == {"g1", "g1.pos", "__pad__"}
    buf = open_entry(wire)
    assert len(buf) < capacity                   # read up to the pad, not the whole file
    got, _ = points_from_bytes(buf)
    assert list(got) == [1] and got[1][0].tolist() == [7] and got[1][1].tolist() == [[1.0, 1.0]]
    assert torch.equal(pts[3][1], rows[:30]) and torch.equal(pts[5][1], rows[30:])
    # A larger one grows it.
    big = RequestStore()
    big.add((2,), np.arange(100), torch.randn(100, 64), last_only=False)
    wire = big.to_wire({}, target)
    got, _ = points_from_bytes(open_entry(wire))
    assert torch.equal(got[2][1], big.points()[2][1])
    assert len(_spilled(tmp_path)) == 1
    # The sweep deletes stale files, free or not.
    stale = s.to_wire({}, target)["path"]
    os.utime(stale, (0, 0))
    fresh = s.to_wire({}, target)["path"]
    assert sweep_spilled(str(tmp_path), max_age_s=600) == 1
    assert _spilled(tmp_path) == [os.path.basename(fresh)]
    os.unlink(fresh)
    # A frontend whose probe this worker cannot see (another container, another host).
    elsewhere = {"dir": str(tmp_path), "probe": "vllm_hook-probe-of-someone-else"}
    assert set(s.to_wire({}, elsewhere)) == {"blob"}
    os.unlink(tmp_path / target["probe"])        # swept: the next fetch re-makes one
    assert set(s.to_wire({}, spill_target(str(tmp_path)))) == {"path"}
    assert set(s.to_wire({}, spill_target(str(tmp_path / "missing")))) == {"blob"}
    assert set(s.to_wire({}, None)) == {"blob"}
    empty = RequestStore()
    empty.add((1,), np.array([], dtype=np.int64), torch.zeros(0, 4), last_only=False)
    wire = empty.to_wire({}, spill_target(str(tmp_path)))
    assert points_from_bytes(open_entry(wire))[0][1][1].shape == (0, 4)
    for f in _spilled(tmp_path):
        os.unlink(tmp_path / f)


def test_spill_keeps_a_bounded_total_of_free_files(tmp_path, monkeypatch):
    from vllm_hook.delivery import spill

    monkeypatch.setattr(spill, "KEEP_FREE_BYTES", 4000)
    target = spill.spill_target(str(tmp_path))
    wires = []
    for _ in range(3):
        s = RequestStore()
        s.add((0,), np.arange(100), torch.ones(100, 2), last_only=False)     # 1768-byte files
        wires.append(s.to_wire({}, target))
    for w in wires:
        spill.open_entry(w)
    free = [f for f in _spilled(tmp_path) if f.startswith(spill.FREE)]
    assert len(free) == 2 == len(_spilled(tmp_path))
    for f in free:
        os.unlink(tmp_path / f)


def test_spill_maps_a_file_too_large_to_keep(tmp_path, monkeypatch):
    """Over KEEP_FREE_BYTES a spilled file is mapped, not read, and deleted at once: the
    results view its pages (no copy of the payload) and may change them."""
    from vllm_hook.delivery import spill

    monkeypatch.setattr(spill, "KEEP_FREE_BYTES", 1000)
    s = RequestStore()
    rows = torch.randn(100, 8).to(torch.bfloat16)
    s.add((2,), np.arange(100), rows, last_only=False)
    wire = s.to_wire({}, spill.spill_target(str(tmp_path)))
    size = os.path.getsize(wire["path"])
    buf = spill.open_entry(wire)
    assert _spilled(tmp_path) == [] and len(buf) == size       # deleted, nothing to reuse
    pts, _ = points_from_bytes(buf)
    assert torch.equal(pts[2][1], rows) and pts[2][0].tolist() == list(range(100))
    # The rows are a view of the mapping, not a copy; writable.
    assert pts[2][1].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    pts[2][1].zero_()
    assert not pts[2][1].any()


def test_store_splits_point_major_blocks_per_point():
    s = RequestStore()
    # two points, two steps: step 1 positions [0, 1], step 2 position [2]
    s.add((4, 7), np.array([0, 1]), torch.tensor([[40.0], [41.0], [70.0], [71.0]]), last_only=False)
    s.add((4, 7), np.array([2]), torch.tensor([[42.0], [72.0]]), last_only=False)
    pts = s.points()
    assert pts[4][0].tolist() == pts[7][0].tolist() == [0, 1, 2]
    assert pts[4][1].flatten().tolist() == [40.0, 41.0, 42.0]
    assert pts[7][1].flatten().tolist() == [70.0, 71.0, 72.0]


def test_store_last_only_keeps_two_newest():
    s = RequestStore()
    for p in range(5):
        s.add((1,), np.array([p]), torch.tensor([[float(p)]]), last_only=True)
    pos, rows = s.points()[1]
    assert pos.tolist() == [3, 4]


@pytest.mark.parametrize("K", [1, 2, 3])
def test_per_layer_views_are_16_byte_aligned(K):
    """Inductor compiles one graph for all layers and, on a GPU, clones at run time every
    input whose address is not 16-byte aligned: an odd int64 column cost a 3.8 MB copy per
    layer and step on the H200. Every view the layers read must start aligned."""
    from vllm_hook.config import HookConfig
    from vllm_hook.model.buffers import BufferShape, HookBuffers, cap_points
    from vllm_hook.model.layout import PointTable

    cfg = HookConfig(sites=("resid_post", "resid_pre", "attn_out", "mlp_out"), max_ops_per_layer=K)
    points = PointTable.for_config(5, cfg)
    shape = BufferShape.for_engine(num_layers=5, hidden=16, max_num_batched_tokens=32, max_num_seqs=4,
                                   cfg=cfg, points=points)
    bufs = HookBuffers(shape, dtype=torch.float32, device=torch.device("cpu"))
    views = [bufs.op_cols(i) for i in range(5)] + [bufs.cap_col(p) for p in range(points.n_points)]
    assert all(v.data_ptr() % 16 == 0 for v in views)
    assert all(v.shape[1] == K for v in views[:5])
    # the logical view the router writes through is the columns the layers read
    cap_points(bufs.cap_idx)[3, 4] = 7
    assert int(bufs.cap_col(4)[3]) == 7


def test_results_are_float32_or_the_captured_dtype_and_own_their_memory(tmp_path):
    from vllm_hook.delivery.spill import open_entry, spill_target
    from vllm_hook.model.layout import PointTable
    from vllm_hook.results import build

    table = PointTable(2, ("resid_post", "resid_pre"))
    items = [{"site": "resid_post", "layer": 0, "sel": "all", "pos": []},
             {"site": "resid_pre", "layer": 1, "sel": "all", "pos": []},      # the same point
             {"site": "resid_post", "layer": 1, "sel": "last", "pos": []}]
    p0, p1 = table.col("resid_post", 0), table.col("resid_post", 1)
    rows = torch.randn(2 * 4, 3).to(torch.bfloat16)
    s = RequestStore()
    s.add((p0, p1), np.arange(4), rows, last_only=False)
    target = spill_target(str(tmp_path))
    for dtype, want, spill in (("float32", torch.float32, target), ("model", torch.bfloat16, target),
                               ("model", torch.bfloat16, None)):
        wire = s.to_wire({"rank": 0}, spill)
        r = build([open_entry(wire)], items, table, request_id="r", prompt_token_ids=[5, 6, 7],
                  output_token_ids=[8, 9], dtype=dtype)
        post0, pre1 = r.activations["resid_post"][0], r.activations["resid_pre"][1]
        assert post0.dtype == pre1.dtype == r.activations["resid_post"][1].dtype == want
        assert torch.equal(post0.float(), rows[:4].float()) and torch.equal(pre1, post0)
        assert post0.data_ptr() != pre1.data_ptr()
        assert torch.equal(r.activations["resid_post"][1].float(), rows[7:8].float())
        assert r.ok, r.errors
        post0 += 1                                 # writable, and only this tensor changes
        assert not torch.equal(pre1, post0)
        r.save(tmp_path / f"{dtype}.safetensors")   # no two tensors share memory
    assert [f for f in os.listdir(tmp_path) if f.startswith("vllm_hook-free-")]


def test_copy_many_splits_large_copies_over_threads(monkeypatch, tmp_path):
    from vllm_hook.delivery import hostmem

    monkeypatch.setattr(hostmem, "COPY_THREADS", 4)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(hostmem, "_torch_parallel", lambda: False)    # as in a vLLM worker
    srcs = [torch.randn(300, 7).to(torch.bfloat16), torch.arange(5000, dtype=torch.uint8),
            torch.randn(0, 3), torch.randn(1, 2000)]
    pairs = [(hostmem.host_empty(s.shape, torch.float32 if s.is_floating_point() else s.dtype), s)
             for s in srcs]
    hostmem.copy_many(pairs)
    for d, s in pairs:
        assert torch.equal(d, s.to(d.dtype))
    big = hostmem.host_empty((5 << 20,), torch.uint8)            # huge-page path, 2 MiB aligned
    assert big.data_ptr() % hostmem.HUGE == 0 and big.is_contiguous()
    with torch.inference_mode():        # as in vLLM's worker: its tensors are inference tensors
        dst, src = torch.empty(4000), torch.randn(4000)
        hostmem.copy_many([(dst, src)])
    assert torch.equal(dst, src)
    # File writes (through a mapping) and reads in parallel pieces, at offsets.
    data = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (7000, 1, 3333)]
    with open(tmp_path / "f", "w+b") as f:
        os.posix_fallocate(f.fileno(), 0, 10334)
        hostmem.write_mapped(f.fileno(), 10334, [(data[0], 0), (data[1], 7000), (data[2], 7001)])
        back = hostmem.host_empty((10334,), torch.uint8)
        hostmem.read_into(f.fileno(), back)
    assert torch.equal(back, torch.cat(data))


def test_collector_keeps_large_pinned_steps_within_a_budget(monkeypatch):
    """On a GPU a prompt-sized step stays in its pinned buffer until its store lets it go
    (no copy into fresh memory); small steps, and any beyond the budget, are copied out."""
    import gc

    import numpy as np

    from vllm_hook.delivery import collector as col
    from vllm_hook.routing import Segment

    monkeypatch.setattr(col, "KEEP_PINNED_MIN", 64)
    monkeypatch.setattr(col, "KEEP_PINNED_BYTES", 1000)
    got: list = []
    c = col.Collector([torch.zeros(100, 4)], lambda seg, rows: got.append(rows))
    c.on_device = True                     # the hand-over a GPU takes, with CPU "pinned" blocks

    def step(n_rows):
        host = torch.randn(n_rows, 4)
        seg = Segment(owner=None, points=(0,), pool_start=0, positions=np.arange(n_rows), last_only=False)
        c._hand_over({0: host}, [seg], [])
        return host

    big = step(8)                          # 128 bytes: kept, a view of the pinned block
    assert got[-1].data_ptr() == big.data_ptr() and c.pinned_kept == 128
    small = step(2)                        # 32 bytes: copied out
    assert got[-1].data_ptr() != small.data_ptr() and torch.equal(got[-1], small)
    hosts = [step(8) for _ in range(7)]
    assert c.pinned_kept == 7 * 128        # the 8th would pass the budget: copied out
    assert got[-1].data_ptr() != hosts[-1].data_ptr() and torch.equal(got[-1], hosts[-1])
    got.clear()
    gc.collect()
    assert c.pinned_kept == 0              # released as the stores drop their rows
    # A small step of two requests: one copy, each request's rows a view of it.
    host = torch.randn(3, 4)
    segs = [Segment(owner=None, points=(0,), pool_start=0, positions=np.arange(1), last_only=False),
            Segment(owner=None, points=(0,), pool_start=1, positions=np.arange(2), last_only=False)]
    c._hand_over({0: host}, segs, [])
    assert torch.equal(got[0], host[:1]) and torch.equal(got[1], host[1:])
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr() != host.data_ptr()


def test_table_writes_wait_for_the_flush_and_keep_the_last_write():
    """The op and vector rows of admitted requests are written at the step's routing (on a GPU
    uploaded from pinned memory without waiting: a copy from ordinary memory synchronised the
    stream at every admission, run 22); a row written twice before a flush ends with its last
    write."""
    from vllm_hook.config import HookConfig
    from vllm_hook.model.buffers import BufferShape, HookBuffers
    from vllm_hook.model.layout import PointTable
    from vllm_hook.worker.tables import DeviceTables

    cfg = HookConfig()
    shape = BufferShape.for_engine(num_layers=3, hidden=8, max_num_batched_tokens=16, max_num_seqs=4,
                                   cfg=cfg, points=PointTable.for_config(3, cfg))
    bufs = HookBuffers(shape, dtype=torch.float32, device=torch.device("cpu"))
    t = DeviceTables(bufs)
    prm0, k = bufs.op_prm.clone(), bufs.op_prm.shape[1]
    a = t.acquire_ops([[1.0] * k])
    t.release_ops(a)
    b = t.acquire_ops([[6.0] * k, [11.0] * k])
    assert a[0] in b                                # the released row, written twice
    v = t.acquire_vector("d", np.arange(1, 9, dtype=np.float32))
    assert torch.equal(bufs.op_prm, prm0) and not bufs.unit[v].any()
    t.flush()
    assert bufs.op_prm[b[0]].tolist() == [6.0] * k and bufs.op_prm[b[1]].tolist() == [11.0] * k
    assert torch.allclose(bufs.unit[v], torch.arange(1, 9.0) / torch.arange(1, 9.0).norm())
    assert not t._ops and not t._vecs


def test_coalesce_merges_copies_that_lie_back_to_back():
    from vllm_hook.delivery.hostmem import coalesce, copy_many

    src = torch.randn(4, 6).to(torch.bfloat16)
    dst = torch.empty(4, 6)
    pairs = [(dst[i], src[i]) for i in range(4)]
    merged = coalesce(pairs)
    assert len(merged) == 1 and merged[0][0].numel() == 24
    gap = torch.empty(5, 6)                              # destination rows not back to back
    assert len(coalesce([(gap[0], src[0]), (gap[2], src[1])])) == 2
    other = torch.randn(6)                               # a source from another storage
    assert len(coalesce([(dst[0], src[0]), (dst[1], other)])) == 2
    copy_many(pairs)
    assert torch.equal(dst, src.float())


def test_repeated_decode_steps_are_delivered_per_run(monkeypatch):
    """Decode steps that repeat one routing go into a run buffer, one copy per step, and reach
    each request's store as one chunk per run, positions and rows as if delivered per step; a
    full run, a new routing and the end of the batch close it, in order. A run's rows reach
    the stores as views of its buffer (no copy; its bytes held against the pinned budget until
    the stores let them go), "last" selections as copies."""
    import gc

    from vllm_hook.delivery import runs
    from vllm_hook.delivery.collector import Collector
    from vllm_hook.delivery.store import RequestStore
    from vllm_hook.routing import Segment, StepRouting

    pool = torch.zeros(16, 3)
    stores = {"a": RequestStore(), "b": RequestStore()}
    c = Collector([pool, None, None], lambda seg, rows, blocked=False: stores[seg.owner].add(
        seg.points, seg.positions, rows, seg.last_only, blocked))
    # a: 2 points at pool rows 0-1, position 10; b: "last" at pool row 2, position 4.
    template = StepRouting([Segment("a", (0, 5), 0, np.array([10]), False, 0, np.array([0])),
                            Segment("b", (1,), 2, np.array([4]), True, 0, np.array([1]))], {0: 3})
    monkeypatch.setattr(runs, "RUN_BYTES", 3 * 3 * 4 * 4)     # 4 steps per run
    written = []

    def forward(k):
        pool[:3] = torch.arange(3 * 3, dtype=torch.float32).view(3, 3) + 100 * k
        written.append(pool[:3].clone())

    forward(0)
    c.after_forward(template)
    for k in range(1, 7):                  # runs of 4 and 2 steps
        forward(k)
        c.after_repeat(template, k)
    assert c.in_flight == 2
    c.after_forward(StepRouting())         # the batch changed: the open run is closed
    c.drain()
    assert c.in_flight == 0
    pos, rows = stores["a"].points()[5]
    assert pos.tolist() == list(range(10, 17))
    assert torch.equal(rows, torch.stack([w[1] for w in written]))
    assert torch.equal(stores["a"].points()[0][1], torch.stack([w[0] for w in written]))
    pos, rows = stores["b"].points()[1]   # "last": only the newest rows are kept
    assert pos.tolist()[-1] == 10 and torch.equal(rows[-1], written[-1][2])
    run_chunks = stores["a"]._chunks[(0, 5)][1:]
    assert len(run_chunks) == 2 and all(not r.is_contiguous() for _, r in run_chunks)   # views
    # Each view is charged its share of its buffer: 4 slots, the second run filled 2.
    assert c.pinned_kept == 4 * 2 * 3 * 4 + 2 * 2 * 3 * 4 * 2
    stores.clear()
    del run_chunks, rows
    gc.collect()
    assert c.pinned_kept == 0

def test_decode_runs_lie_in_the_arena_trimmed_to_their_steps():
    """With an arena, a run's buffer is a block of it with room for MAX_STEPS steps, given back
    but for its steps when the run closes; the stores' rows are views of it (lent at fetch),
    equal to the pool's rows step by step; the block is free once the stores let go."""
    import gc

    from vllm_hook.delivery.collector import Collector
    from vllm_hook.delivery.store import RequestStore
    from vllm_hook.routing import Segment, StepRouting

    pool = torch.zeros(16, 1024)
    stores = [RequestStore()]
    c = Collector([pool, None, None], lambda seg, rows, blocked=False: stores[0].add(
        seg.points, seg.positions, rows, seg.last_only, blocked), arena_bytes=32 << 20)
    template = StepRouting([Segment("a", (0, 5, 7), 0, np.array([10]), False, 0, np.array([0]))], {0: 3})
    written = []
    for k in range(7):
        pool[:3] = torch.randn(3, 1024)
        written.append(pool[:3].clone())
        c.after_forward(template) if k == 0 else c.after_repeat(template, k)
    c.after_forward(StepRouting())
    c.drain()
    assert c.arena.used == 6 * 3 * 1024 * 4          # six steps of the room for 256
    (_, first), (_, run_rows) = stores[0]._chunks[(0, 5, 7)]
    assert c.arena.holds(run_rows) and not run_rows.is_contiguous()
    pos, rows = stores[0].points()[7]
    assert pos.tolist() == list(range(10, 17)) and torch.equal(rows, torch.stack([w[2] for w in written]))
    del first, run_rows, rows
    stores.clear()
    gc.collect()
    assert c.arena.stats()["arena_used_bytes"] == 0


def test_attention_scores_in_chunks_equal_one_pass(monkeypatch):
    """Chunked over query rows (bounded device memory) = the one-pass softmax (to float
    rounding: BLAS may block a 5-row product differently from a 37-row one)."""
    from vllm_hook.model import attention

    g = torch.Generator().manual_seed(3)
    n, h, kvh, D, K = 37, 4, 2, 8, 40
    q, keys = torch.randn(n, h, D, generator=g), torch.randn(K, kvh, D, generator=g)
    kv_of_head, q_pos = torch.tensor([0, 0, 1, 1]), torch.arange(3, 3 + n)
    args = (q, keys, kv_of_head, q_pos, 0.3, 30.0, 16, K + 5)
    one = attention.attention_scores(*args)
    monkeypatch.setattr(attention, "CHUNK_ELEMENTS", h * K * 5)      # 5 rows per chunk
    chunked = attention.attention_scores(*args)
    assert one.shape == chunked.shape == (n, h, K + 5)
    assert torch.allclose(one, chunked, rtol=0, atol=1e-6) and torch.equal(one == 0, chunked == 0)
    # A reference: softcapped, causal, windowed softmax per row.
    logits = 30.0 * torch.tanh(torch.einsum("nhd,khd->nhk", q, keys[:, kv_of_head]) * 0.3 / 30.0)
    kpos = torch.arange(K)
    mask = (kpos[None] > q_pos[:, None]) | (kpos[None] <= q_pos[:, None] - 16)
    ref = torch.softmax(logits.masked_fill(mask[:, None], float("-inf")), -1)
    assert torch.allclose(one[..., :K], ref, atol=1e-6) and not one[..., K:].any()
