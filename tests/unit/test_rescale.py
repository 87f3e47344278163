"""Specs equal but for their steering numbers (`spec.rescale`, the frontend's admission and the
workers' steering shapes): what the shape path makes equals what the full way makes, and any
number the full way could refuse goes the full way."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hook.adapters.base import NewRequest, SchedulerEvents
from vllm_hook.config import HookConfig
from vllm_hook.frontend.admission import _admit
from vllm_hook.frontend.state import STATE_ATTR, FrontendState
from vllm_hook.model.buffers import OP_ROW_BITS, BufferShape, HookBuffers
from vllm_hook.model.layout import PointTable
from vllm_hook.routing import group_steering
from vllm_hook.spec import ModelInfo, SpecError, parse_spec, resolve
from vllm_hook.spec.rescale import rescaled, split, template
from vllm_hook.spec.resolve import unpack_steer
from vllm_hook.worker.runtime import HookRuntime

L, H = 4, 8
INFO = ModelInfo(num_layers=L, hidden_size=H, name="tiny", dtype="bfloat16")
CFG = HookConfig(projection_layers="all", capture_pool_rows=256)
V = [0.5] * H
VALUES = {"v": np.full(H, 0.5, np.float32), "w": np.linspace(-1, 1, H, dtype=np.float32)}   # on the workers
NAMES = {"v": ("d" * 32, 1.4142135623730951), "w": ("e" * 32, 2.0)}

SHAPES = [
    {"steer": [{"op": "add", "layer": x, "vector": "v", "scale": 0.5} for x in range(L)]},
    {"steer": [{"op": "add", "layer": 1, "vector": "v"}, {"op": "add", "layer": 2, "vector": V, "scale": 2,
                                                          "norm_match": True}]},
    {"steer": [{"op": "cap", "layer": 0, "vector": "w", "min": -1.0},
               {"op": "cap", "layer": 1, "vector": "w", "min": -1.0, "max": 3},
               {"op": "ablate", "layer": 2, "vector": "v", "scale": 0.25},
               {"op": "ablate", "layer": 3, "vector": "v"}]},
    # ops sharing a layer on other tokens, positions counted from the prompt's end, a capture
    {"steer": [{"op": "add", "layer": 1, "vector": "v", "scale": 1.0, "tokens": [-1, 0]},
               {"op": "add", "layer": 2, "vector": "w", "scale": 1.5},
               {"op": "ablate", "layer": 2, "vector": "v", "scale": 0.5, "tokens": [3]}],
     "capture": [{"layers": [1], "tokens": "last_prompt"}]},
]


def _full(raw, prompt_len=10):
    return resolve(parse_spec(raw), INFO, CFG, prompt_len, NAMES.get, max_model_len=64)


def _template(raw, prompt_len=10):
    spec, res = parse_spec(raw), _full(raw, prompt_len)
    return template(spec, res, INFO, CFG.max_ops_per_layer)


def _scaled(raw, f):
    """`raw` with every steering number times `f`."""
    ops = [{k: (v * f if k in ("scale", "min", "max") else v) for k, v in op.items()} for op in raw["steer"]]
    return {**raw, "steer": ops}


def _same(a, b):
    """Equal resolutions but for their keys."""
    wa, wb = dict(a.wire), dict(b.wire)
    assert wa.pop("key") != wb.pop("key")
    assert wa == wb
    assert {**a.__dict__, "wire": None, "key": None, "worst_bytes": None} == \
        {**b.__dict__, "wire": None, "key": None, "worst_bytes": None}


@pytest.mark.parametrize("raw", SHAPES)
@pytest.mark.parametrize("f", [1.0, 0.5, 3.0, 0.0])
def test_rescaled_equals_resolved(raw, f):
    other = _scaled(raw, f)
    a, b = split(raw), split(other)
    assert a[0] == b[0]                              # one shape
    got = rescaled(_template(raw), b[1], 10)
    _same(got, _full(other))
    # a JSON string (as served) splits the same
    assert split(json.dumps(other)) == b


def test_a_template_serves_other_prompt_lengths_unless_positions_are_named():
    raw = SHAPES[0]
    other = _scaled(raw, -2.0)
    _same(rescaled(_template(raw, 10), split(other)[1], 17), _full(other, 17))


@pytest.mark.parametrize("raw, op, field, value", [
    (SHAPES[0], 0, "scale", math.nan), (SHAPES[0], 0, "scale", math.inf), (SHAPES[0], 0, "scale", 1e300),
    (SHAPES[1], 1, "scale", 1e300), (SHAPES[2], 0, "min", math.nan), (SHAPES[2], 1, "min", 5.0),
    (SHAPES[2], 2, "scale", -1e300), (SHAPES[0], 0, "scale", 10 ** 400),
    (SHAPES[2], 0, "min", math.inf), (SHAPES[2], 1, "max", -math.inf),
])
def test_a_number_the_full_way_refuses_goes_the_full_way(raw, op, field, value):
    other = json.loads(json.dumps(raw))
    other["steer"][op][field] = value
    sp = split(other)
    assert sp is not None and sp[0] == split(raw)[0]
    assert rescaled(_template(raw), sp[1], 10) is None
    with pytest.raises(SpecError):
        _full(other)


@pytest.mark.parametrize("value", [True, "0.5", None, [1.0], {"x": 1}])
def test_numbers_of_other_types_take_the_full_way(value):
    other = json.loads(json.dumps(SHAPES[0]))
    other["steer"][0]["scale"] = value
    assert split(other) is None


def test_field_names_are_part_of_the_shape():
    a = split({"steer": [{"op": "add", "layer": 0, "vector": "v"}]})
    b = split({"steer": [{"op": "add", "layer": 0, "vector": "v", "scale": 1.0}]})
    assert a[0] != b[0]
    assert split({"steer": [{"op": "add", "layer": 0, "vector": "v"}], "hooks": [{"name": "x"}]}) is None
    assert split({"capture": [{"layers": [0]}]}) is None


def _frontend():
    st = FrontendState(cfg=CFG, info=INFO, points=PointTable.for_config(L, CFG), max_model_len=64)
    st.names.update(NAMES)
    ip = SimpleNamespace()
    ip.__dict__[STATE_ATTR] = st
    return ip, st


def _request(raw, prompt_len=10):
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"vllm_hook": raw},
                                                           skip_reading_prefix_cache=False),
                           prompt_token_ids=list(range(prompt_len)), cache_salt=None)


def test_admission_takes_the_shape_path_from_the_second_spec_of_a_shape_on():
    ip, st = _frontend()
    wires = []
    for i, f in enumerate([1.0, 2.0, 3.0, 4.0]):
        r = _request(_scaled(SHAPES[3], f))
        _admit(ip, str(i), r)
        wires.append(r.sampling_params.extra_args["vllm_hook"])
        assert len(st.resolved._shapes) == (1 if i >= 1 else 0)
    for f, w in zip([1.0, 2.0, 3.0, 4.0], wires):
        full = _full(_scaled(SHAPES[3], f)).wire
        assert {**w, "key": None, "t": None, "W": None} == {**full, "key": None, "t": None, "W": None}
    # its positions count from the prompt's end: another prompt length resolves in full
    r = _request(_scaled(SHAPES[3], 5.0), prompt_len=12)
    _admit(ip, "12", r)
    full = _full(_scaled(SHAPES[3], 5.0), 12).wire
    assert {**r.sampling_params.extra_args["vllm_hook"], "key": None, "W": None} == {**full, "key": None, "W": None}
    assert full["steer"] != _full(_scaled(SHAPES[3], 5.0), 10).wire["steer"]
    # an out-of-bounds number on the shape path gets the full way's error
    with pytest.raises(SpecError, match="steer"):
        _admit(ip, "bad", _request(_scaled(SHAPES[3], 1e300)))
    st.resolved.clear()                   # a vector registered or deleted
    assert not st.resolved._shapes


@pytest.mark.parametrize("raw", [SHAPES[0], SHAPES[3]])
def test_a_sweep_repeating_its_strengths_finds_them_kept(raw):
    """A spec resolved from its shape's template is kept by its exact content: the sweep's
    later requests at that strength are a lookup (for a spec naming positions, at that prompt
    length only), each with a wire of its own, equal to the full way's."""
    ip, st = _frontend()
    for i, f in enumerate([1.0, 2.0, 3.0]):
        _admit(ip, str(i), _request(_scaled(raw, f)))
    hits = st.resolved.hits
    r = _request(_scaled(raw, 2.0))
    _admit(ip, "again", r)
    assert st.resolved.hits == hits + 1
    w = r.sampling_params.extra_args["vllm_hook"]
    assert {**w, "key": None, "t": None, "W": None} == {**_full(_scaled(raw, 2.0)).wire, "key": None, "t": None, "W": None}
    w["steer"] = b"changed by its request"            # a request's wire is its own
    r2 = _request(_scaled(raw, 2.0))
    _admit(ip, "thrice", r2)
    w2 = r2.sampling_params.extra_args["vllm_hook"]
    assert w2["key"] != w["key"] and w2["steer"] == _full(_scaled(raw, 2.0)).wire["steer"]
    # another prompt length: the kept one serves it unless the spec names positions
    r3 = _request(_scaled(raw, 2.0), prompt_len=12)
    _admit(ip, "longer", r3)
    assert st.resolved.hits == hits + 2 + (raw is SHAPES[0])
    assert {**r3.sampling_params.extra_args["vllm_hook"], "key": None, "t": None, "W": None} == \
        {**_full(_scaled(raw, 2.0), 12).wire, "key": None, "t": None, "W": None}


def _runtime():
    points = PointTable.for_config(L, CFG)
    shape = BufferShape.for_engine(num_layers=L, hidden=H, max_num_batched_tokens=64, max_num_seqs=8,
                                   cfg=CFG, points=points)
    rt = HookRuntime(HookBuffers(shape, torch.float32, torch.device("cpu")), points, CFG)
    rt.register_vectors({k: v.tobytes() for k, v in VALUES.items()})
    return rt


def _admitted(rt, raws, tag):
    names = {"v": None, "w": None}
    wires = []
    for raw in raws:
        res = resolve(parse_spec(raw), INFO, CFG, 10, lambda n: (_digest(rt, n), _norm(n)) if n in names else None,
                      max_model_len=64)
        wires.append(res.wire)
    new = tuple(NewRequest(f"{tag}{i}", w, 10) for i, w in enumerate(wires))
    rt.on_events(SchedulerEvents(new=new))
    return [rt.requests[nr.req_id] for nr in new]


def _digest(rt, name):
    from vllm_hook.spec.vectors import vector_digest
    return vector_digest(VALUES[name])


def _norm(name):
    return float(np.linalg.norm(VALUES[name].astype(np.float64)))


def _params(rt, req):
    """The parameter rows queued for a request's ops, in op order."""
    rows = {r: v for rs, vs in rt.tables._ops for r, v in zip(rs, vs)}
    return np.stack([rows[e & ((1 << OP_ROW_BITS) - 1)] for g in req.routes.steer_groups for e in g[3]])


@pytest.mark.parametrize("raw", [SHAPES[0], SHAPES[2], SHAPES[3]])
def test_worker_shape_path_admits_as_a_fresh_worker(raw):
    """A worker that admitted a spec of this shape before (at another strength) admits a
    spec into the same routes, groups and parameter rows as a worker that never saw it."""
    raw = {**raw, "capture": []}
    warm, cold = _runtime(), _runtime()
    _admitted(warm, [raw], "a")                  # the shape's first spec
    assert len(warm._steer_shapes._shapes) == 1
    [got] = _admitted(warm, [_scaled(raw, 0.5)], "b")
    [want] = _admitted(cold, [_scaled(raw, 0.5)], "b")
    assert not got.errors and not want.errors
    assert got.routes.horizon == want.routes.horizon
    ga, gb = got.routes.steer_groups, want.routes.steer_groups
    assert [(g[0], g[1], g[2].tolist()) for g in ga] == [(g[0], g[1], g[2].tolist()) for g in gb]
    assert [g[4] if isinstance(g[4], slice) else g[4].tolist() for g in ga] == \
        [g[4] if isinstance(g[4], slice) else g[4].tolist() for g in gb]
    np.testing.assert_array_equal(_params(warm, got), _params(cold, want))
    # the groups are those group_steering makes of the routes
    ref = group_steering(got.routes.steer)
    assert [(g[0], g[1], g[2].tolist(), g[3].tolist()) for g in ref] == \
        [(g[0], g[1], g[2].tolist(), g[3].tolist()) for g in ga]
    # and finishing releases every row
    for rt in (warm, cold):
        rt.on_events(SchedulerEvents(finished=frozenset(rt.requests)))
        assert rt.tables.vectors_in_use == 0 and rt.tables.ops_in_use == 0


def test_worker_shape_path_checks_the_coefficients():
    rt = _runtime()
    _admitted(rt, [SHAPES[0]], "a")
    res = _full(_scaled(SHAPES[0], 0.5))
    cols = unpack_steer(res.wire["steer"])
    from vllm_hook.spec.resolve import coefficients, pack_steer
    cols["c"] = [math.nan, *coefficients(cols["c"])[1:]]
    wire = {**res.wire, "steer": pack_steer(cols), "sd": "other"}
    rt.on_events(SchedulerEvents(new=(NewRequest("bad", wire, 10),)))
    assert "coefficients" in " ".join(rt.requests["bad"].errors)


def test_worker_shape_path_takes_a_new_vector_from_the_wire_it_arrives_in():
    """A shape first admitted with a registered name, later steered with the same values sent
    inline after the name was deleted: the vector comes from the later wire, not the name."""
    rt = _runtime()
    named = {"steer": [{"op": "add", "layer": x, "vector": "v", "scale": 0.5} for x in range(L)]}
    inline = _scaled({"steer": [{**op, "vector": [0.5] * H} for op in named["steer"]]}, 2.0)
    [first] = _admitted(rt, [named], "a")
    assert not first.errors
    rt.on_events(SchedulerEvents(finished=frozenset(rt.requests)))
    rt.delete_vectors(["v"])
    assert rt.tables.vectors_in_use == 0
    [later] = _admitted(rt, [inline], "b")
    assert len(rt._steer_shapes._shapes) == 1 and not later.errors, later.errors
    # the name is gone: while a row holds its values a request naming it steers with them,
    [again] = _admitted(rt, [_scaled(named, 3.0)], "c")
    assert again.errors == []
    rt.on_events(SchedulerEvents(finished=frozenset(rt.requests)))
    # and once none does it fails as before
    [gone] = _admitted(rt, [_scaled(named, 4.0)], "d")
    assert "not registered" in " ".join(gone.errors), gone.errors


def test_worker_admits_in_full_a_wire_whose_columns_are_not_its_shapes():
    """A wire naming a kept shape but carrying other vectors (never made by the frontend) is
    checked and admitted in full, from its own columns."""
    rt = _runtime()
    v_spec = {"steer": [{"op": "add", "layer": x, "vector": "v", "scale": 0.5} for x in range(L)]}
    w_spec = {"steer": [{**op, "vector": "w"} for op in v_spec["steer"]]}
    v, w = (resolve(parse_spec(s), INFO, CFG, 10, lambda n: (_digest(rt, n), _norm(n)), max_model_len=64).wire
            for s in (v_spec, w_spec))
    _admitted(rt, [v_spec], "a")
    rt.on_events(SchedulerEvents(new=(NewRequest("w", {**w, "ss": v["ss"]}, 10),)))   # w's columns, v's shape
    assert not rt.requests["w"].errors
    row = rt.shared_steering[w["sd"]].vec_rows[0][0]
    np.testing.assert_allclose(rt.tables.units[row], VALUES["w"] / np.linalg.norm(VALUES["w"]), rtol=1e-6)


def test_an_empty_block_of_ops_queues_nothing():
    rt = _runtime()
    assert rt.tables.acquire_ops(np.zeros((0, 4 + CFG.max_ops_per_layer))) == []
    rt.tables.flush()


@pytest.mark.parametrize("blob", [b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa1c\xa3abc"])
def test_a_kept_shapes_malformed_blob_fails_that_request_only(blob):
    """A wire naming a kept shape whose blob is not one the frontend makes (not msgpack, not a
    map, a map without the columns) is read the full way, which fails that request alone."""
    rt = _runtime()
    [ok] = _admitted(rt, [SHAPES[0]], "a")
    wire = {**_full(_scaled(SHAPES[0], 0.5)).wire, "steer": blob, "sd": "other"}
    rt.on_events(SchedulerEvents(new=(NewRequest("bad", wire, 10),)))
    assert rt.requests["bad"].errors and not ok.errors
    assert "bad" not in rt.active and ok.req_id in rt.active


def test_equal_numbers_are_one_steering_whatever_their_spelling():
    """0 and 0.0, 1 and 1.0: the coefficients travel as float64 bytes, so specs equal in value
    share one steering digest (and the workers' rows), by the full way or the template's."""
    ints = {"steer": [{"op": "add", "layer": 1, "vector": "v", "scale": 1}]}
    floats = {"steer": [{"op": "add", "layer": 1, "vector": "v", "scale": 1.0}]}
    a, b = _full(ints), _full(floats)
    assert a.steer_digest == b.steer_digest and a.wire["steer"] == b.wire["steer"]
    assert rescaled(_template(floats), split(ints)[1], 10).steer_digest == a.steer_digest


def test_a_capturing_requests_max_tokens_rides_its_own_wire():
    """"M" (the worker ends open-ended routes at the last forwarded position) is each
    request's own, however many share the spec; a steering-only wire has none."""
    ip, _ = _frontend()
    spec = {"capture": [{"layers": [1], "tokens": "all"}]}
    wires = []
    for i, m in enumerate([1, 7, None]):
        r = _request(spec)
        r.sampling_params.max_tokens = m
        _admit(ip, str(i), r)
        wires.append(r.sampling_params.extra_args["vllm_hook"])
    assert [w.get("M") for w in wires] == [1, 7, None]
    r = _request(SHAPES[0])
    r.sampling_params.max_tokens = 4
    _admit(ip, "s", r)
    assert "M" not in r.sampling_params.extra_args["vllm_hook"]
    # nothing is forwarded past max_model_len (64 here): "unlimited" is bounded by it
    r = _request(spec)
    r.sampling_params.max_tokens = 1 << 62
    _admit(ip, "big", r)
    assert r.sampling_params.extra_args["vllm_hook"]["M"] == 64
    # a resumable request's next chunk resets its max_tokens: no bound
    r = _request(spec)
    r.sampling_params.max_tokens, r.resumable = 3, True
    _admit(ip, "resumable", r)
    assert "M" not in r.sampling_params.extra_args["vllm_hook"]


def test_an_offline_float32_capture_of_prompt_rows_is_widened_on_the_device(monkeypatch):
    """Wire "W" (`admission._widen_on_device`): workers send float32 rows where the frontend
    would widen them anyway and only prompt rows are captured; never served, in the model's
    dtype, for attention scores, for rows of generated tokens or where its float32 rows would
    pass max_capture_bytes_per_request (a large one is not refused for that: sent in the model's
    dtype)."""
    from vllm_hook.frontend.state import SERVED

    ip, st = _frontend()

    def wire(spec, max_tokens=None):
        r = _request(spec)
        r.sampling_params.max_tokens = max_tokens
        _admit(ip, "r", r)
        return r.sampling_params.extra_args["vllm_hook"].get("W")

    every = {"capture": [{"layers": [1, 2], "tokens": "all"}]}
    assert wire({"capture": [{"layers": [1], "tokens": "last_prompt"}]}) == 1
    assert wire({"capture": [{"layers": [1], "tokens": [0, 9]}]}) == 1      # prompt positions
    assert wire({"capture": [{"layers": [1], "tokens": [0, 10]}]}) is None   # a generated one
    assert wire(every, max_tokens=1) == 1 and wire(every, max_tokens=2) is None and wire(every) is None
    assert wire({**every, "dtype": "model"}, max_tokens=1) is None
    from vllm_hook.spec.resolve import _widen_when
    assert _widen_when([{"site": "attn_scores", "layer": 1, "sel": "last_prompt", "pos": []}], 10) == 0
    monkeypatch.setitem(st.__dict__, "_capture_limit", 2 * 10 * H * 4 - 1)   # 2 layers, 10 rows
    assert wire(every, max_tokens=1) is None
    monkeypatch.setitem(st.__dict__, "_capture_limit", 1 << 40)       # no cap of its own beyond it
    monkeypatch.setattr(st, "info", dataclasses.replace(INFO, hidden_size=1 << 20))
    assert wire({"capture": [{"layers": [1, 2], "tokens": "all"}]}, max_tokens=1) == 1     # 80 MiB in float32
    monkeypatch.undo()
    monkeypatch.setitem(SERVED, "on", True)
    assert wire(every, max_tokens=1) is None


def test_no_max_tokens_bound_where_the_engine_forwards_draft_tokens():
    """Speculative decoding forwards draft tokens past a request's last kept position, and
    forwards rejected ones again: its routes stay open to the end."""
    from vllm_hook.adapters.requests import forwards_drafts

    assert forwards_drafts(SimpleNamespace(speculative_config=object()))
    assert forwards_drafts(SimpleNamespace(speculative_config=None, diffusion_config=object()))
    assert not forwards_drafts(SimpleNamespace(speculative_config=None))
    ip, st = _frontend()
    st.drafts = True
    r = _request({"capture": [{"layers": [1], "tokens": "all"}]})
    r.sampling_params.max_tokens = 3
    _admit(ip, "d", r)
    assert "M" not in r.sampling_params.extra_args["vllm_hook"]


def test_the_vllm_fields_the_bound_reads_exist():
    """`forwards_drafts` and `resumable` read vLLM's fields with defaults: a rename would put
    the bound back under speculative decoding or streamed input, silently."""
    import dataclasses

    from vllm.config import VllmConfig
    from vllm.v1.engine import EngineCoreRequest

    from vllm_hook.adapters.requests import forwards_drafts

    assert {"speculative_config", "diffusion_config"} <= {f.name for f in dataclasses.fields(VllmConfig)}
    assert "resumable" in EngineCoreRequest.__struct_fields__
    assert not forwards_drafts(VllmConfig())
