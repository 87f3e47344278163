"""Spec parsing and resolution: every invalid input gets a SpecError naming where and the fix."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from vllm_hook.config import HookConfig
from vllm_hook.spec import ModelInfo, SpecError, UnknownVectorError, encode_vector, parse_spec, resolve
from vllm_hook.spec.resolve import steer_ops, unpack_steer
from vllm_hook.spec.vectors import decode_vector

INFO = ModelInfo(num_layers=4, hidden_size=8, name="tiny")
CFG = HookConfig(sites=("resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k"), projection_layers="all")
LEAN = HookConfig()
V = [1.0] * 8


def R(spec, prompt_len=10, names=None, cfg=CFG):
    return resolve(parse_spec(spec), INFO, cfg, prompt_len, (names or {}).get, max_model_len=64)


def test_json_string_and_dict_agree():
    spec = {"capture": [{"layers": [0, -1], "tokens": "last_prompt"}]}
    a, b = R(spec), R(json.dumps(spec))
    assert a.wire["cap"] == b.wire["cap"]
    assert [c["layer"] for c in a.wire["cap"]] == [0, 3]


@pytest.mark.parametrize("spec, where, words", [
    ("{not json", "spec", "malformed JSON"),
    ([1, 2], "spec", "expected an object"),
    ({"captur": []}, "captur", "unknown field"),
    ({"capture": [{"layers": [9]}]}, "capture[0].layers[0]", "out of range"),
    ({"capture": [{"layers": [-5]}]}, "capture[0].layers[0]", "out of range"),
    ({"capture": [{"layers": [], "tokens": "all"}]}, "capture[0].layers", "empty"),
    ({"capture": [{"site": "resid_mid"}]}, "capture[0].site", "resid_post"),
    ({"capture": [{"tokens": "firstish"}]}, "capture[0].tokens", "last_prompt"),
    ({"capture": [{"tokens": [-11]}]}, "capture[0].tokens[0]", "before the start"),
    ({"capture": [{"tokens": [99]}]}, "capture[0].tokens", "max_model_len"),
    ({"steer": [{"op": "shift", "layer": 0, "vector": V}]}, "steer[0]", "op"),
    ({"steer": [{"op": "add", "layer": 4, "vector": V}]}, "steer[0].layer", "out of range"),
    ({"steer": [{"op": "add", "layer": 0, "vector": [1.0] * 7}]}, "steer[0].vector", "expected 8 values"),
    ({"steer": [{"op": "add", "layer": 0, "vector": [math.nan] + [1.0] * 7}]}, "steer[0].vector", "NaN"),
    ({"steer": [{"op": "add", "layer": 0, "vector": [math.inf] + [1.0] * 7}]}, "steer[0].vector", "infinite"),
    ({"steer": [{"op": "add", "layer": 0, "vector": [[1.0] * 8]}]}, "steer[0].vector", "1-D"),
    ({"steer": [{"op": "add", "layer": 0, "vector": "nope"}]}, "steer[0].vector", "no registered vector"),
    ({"steer": [{"op": "ablate", "layer": 0, "vector": [0.0] * 8}]}, "steer[0].vector", "zero norm"),
    ({"steer": [{"op": "cap", "layer": 0, "vector": V}]}, "steer[0]", "min, max"),
    ({"steer": [{"op": "cap", "layer": 0, "vector": V, "min": 2, "max": 1}]}, "steer[0]", "greater than max"),
    ({"steer": [{"op": "add", "layer": 0, "vector": V, "scale": "x"}]}, "steer[0].scale", ""),
    ({"steer": [{"op": "add", "layer": 0, "vector": {"b64": "@@", "dtype": "float32"}}]}, "steer[0].vector", "base64"),
    ({"steer": [{"op": "add", "layer": 0, "vector": {"b64": "AAAA", "dtype": "int8"}}]}, "steer[0].vector", "dtype"),
    ({"steer": [{"op": "add", "layer": 1, "vector": V}] * 3}, "steer[2].layer", "max_ops_per_layer"),
    ({"capture": [{}], "dtype": "bf16"}, "dtype", '"model"'),
    # Coefficients: the one-comparison fast path must leave every failure to the full checks
    ({"steer": [{"op": "add", "layer": 0, "vector": V, "scale": math.nan}]}, "steer[0].scale", "scale is nan"),
    ({"steer": [{"op": "add", "layer": 0, "vector": V, "scale": -math.inf}]}, "steer[0].scale", "scale is -inf"),
    ({"steer": [{"op": "add", "layer": 0, "vector": V, "scale": 1e30}]}, "steer[0].scale", "scale x ||vector||"),
    ({"steer": [{"op": "add", "layer": 0, "vector": V, "scale": 1e30, "norm_match": True}]}, "steer[0].scale",
     "exceeds"),
    ({"steer": [{"op": "ablate", "layer": 0, "vector": V, "scale": math.inf}]}, "steer[0].scale", "scale is inf"),
    ({"steer": [{"op": "cap", "layer": 0, "vector": V, "min": math.nan}]}, "steer[0].min", "min is NaN"),
    ({"steer": [{"op": "cap", "layer": 0, "vector": V, "max": math.nan}]}, "steer[0].max", "max is NaN"),
    ({"steer": [{"op": "cap", "layer": 0, "vector": V, "min": -1e30}]}, "steer[0].min", "|min|"),
    ({"steer": [{"op": "cap", "layer": 0, "vector": V, "max": 1e30}]}, "steer[0].max", "|max|"),
])
def test_invalid_specs(spec, where, words):
    with pytest.raises(SpecError) as e:
        R(spec)
    assert e.value.where == where, str(e.value)
    assert words in str(e.value)
    assert "Fix:" in str(e.value)


def test_unknown_vector_is_its_own_error_type():
    with pytest.raises(UnknownVectorError):
        R({"steer": [{"op": "add", "layer": 0, "vector": "missing"}]})


def test_site_not_instrumented():
    cfg = HookConfig(sites=("resid_post",))
    with pytest.raises(SpecError, match="not instrumented"):
        R({"capture": [{"site": "attn_out"}]}, cfg=cfg)


def test_lean_default_engine_refuses_what_it_did_not_compile():
    with pytest.raises(SpecError, match="vllm_hook.sites including 'q'"):
        R({"capture": [{"site": "attn_scores"}]}, cfg=LEAN)
    for op in ({"op": "cap", "layer": 1, "vector": V, "max": 1.0},
               {"op": "ablate", "layer": 1, "vector": V},
               {"op": "add", "layer": 1, "vector": V, "norm_match": True}):
        with pytest.raises(SpecError, match="projection_layers"):
            R({"steer": [op]}, cfg=LEAN)
    R({"steer": [{"op": "add", "layer": 1, "vector": V}]}, cfg=LEAN)          # plain add: fine
    part = HookConfig(sites=("resid_post", "q"), site_layers=[2], projection_layers=[1])
    capture_only = HookConfig(steer_layers=None)
    with pytest.raises(SpecError, match="steer_layers including 1"):
        R({"steer": [{"op": "add", "layer": 1, "vector": V}]}, cfg=capture_only)
    R({"capture": [{"layers": "all"}]}, cfg=capture_only)
    R({"steer": [{"op": "add", "layer": 1, "vector": V}]}, cfg=part)       # projection layers steer
    assert HookConfig(steer_layers=[0], projection_layers=[2]).steering_layers(4) == {0, 2}
    R({"steer": [{"op": "cap", "layer": 1, "vector": V, "max": 1.0}]}, cfg=part)
    with pytest.raises(SpecError, match="not instrumented at layer 0"):
        R({"capture": [{"site": "q", "layers": [0]}]}, cfg=part)
    assert [c["layer"] for c in R({"capture": [{"site": "q"}]}, cfg=part).wire["cap"]] == [2]


def test_coefficients():
    w = R({"steer": [
        {"op": "add", "layer": 0, "vector": V, "scale": 2.0},
        {"op": "add", "layer": 1, "vector": V, "scale": 0.5, "norm_match": True},
        {"op": "cap", "layer": 2, "vector": V, "max": 1.5},
        {"op": "ablate", "layer": 3, "vector": V, "scale": 0.25},
    ]}).wire["steer"]
    assert isinstance(w, bytes)                # one blob through vLLM's serialisation
    inf = math.inf
    assert [s["c"] for s in steer_ops(w)] == [[2.0, 0, 0, -inf, inf], [0, 0.5, 0, -inf, inf],
                                              [0, 0, 0, -inf, 1.5], [0, 0, -0.75, -inf, inf]]
    # columns, the coefficients flat float64 bytes: the worker reads them as arrays
    cols = unpack_steer(w)
    assert cols["layer"] == [0, 1, 2, 3] and len(cols["c"]) == 20 * 8 and cols["name"] == [None] * 4


def test_vectors_in_every_form():
    arr = np.arange(8, dtype=np.float32)
    for form in ("float32", "float16", "bfloat16"):
        back = decode_vector(encode_vector(arr, form), "v")
        assert np.allclose(back, arr)
    import torch
    assert np.allclose(decode_vector(torch.arange(8.0), "v"), arr)
    assert decode_vector("name", "v") == "name"


def test_steering_salts_and_capture_skips_cache():
    a = R({"steer": [{"op": "add", "layer": 0, "vector": V}]})
    b = R({"steer": [{"op": "add", "layer": 0, "vector": V, "scale": 2.0}]})
    assert a.steer_digest and a.steer_digest != b.steer_digest
    assert R({"capture": [{"tokens": "all"}]}).reads_cached_prefix
    assert not R({"capture": [{"tokens": "last_prompt"}]}).reads_cached_prefix
    assert not R({"capture": [{"tokens": "generated"}]}).reads_cached_prefix


def test_cached_prefix_rule_by_prompt_length():
    """`cached_prefix_from` (one comparison per request where a resolution is reused for
    another length) agrees with the rule it replaced: a capture needs a recomputed prefix when
    it selects a prompt row before the last (vLLM always recomputes that one)."""
    from vllm_hook.spec.resolve import cached_prefix_from

    def rule(caps, P):
        return any((c["sel"] in ("all", "prompt") and P > 1) or (c["sel"] == "pos" and any(p < P - 1 for p in c["pos"]))
                   for c in caps)

    cases = [[], [{"sel": "all"}], [{"sel": "prompt"}], [{"sel": "last_prompt"}], [{"sel": "generated"}],
             [{"sel": "pos", "pos": [5, 9]}], [{"sel": "pos", "pos": []}], [{"sel": "last"}, {"sel": "pos", "pos": [3]}]]
    for caps in cases:
        for P in range(1, 13):
            assert rule(caps, P) == (P >= cached_prefix_from(caps)), (caps, P)
    r = R({"capture": [{"tokens": "all"}]}, prompt_len=1)
    assert not r.reads_cached_prefix and r.prefix_from == 2


def test_named_vector_resolves_to_digest():
    r = R({"steer": [{"op": "add", "layer": 0, "vector": "calm"}]}, names={"calm": ("abc", 1.0)})
    op = steer_ops(r.wire["steer"])[0]
    assert op["name"] == "calm" and op["digest"] == "abc"


def test_empty_spec():
    assert parse_spec({}).is_empty


def test_a_spec_naming_no_positions_resolves_once_for_every_prompt_length(monkeypatch):
    """A dataset's prompts differ in length: a spec without token positions is resolved once,
    each request getting its own "P" and cached-prefix rule; one naming positions (-1: the
    last prompt token) is resolved per length."""
    from types import SimpleNamespace

    from vllm_hook.frontend import admission
    from vllm_hook.frontend.state import STATE_ATTR, FrontendState
    from vllm_hook.model.layout import PointTable

    st = FrontendState(cfg=CFG, info=INFO, points=PointTable.for_config(4, CFG), max_model_len=64)
    ip = SimpleNamespace()
    ip.__dict__[STATE_ATTR] = st
    calls = []
    real = admission.resolve
    monkeypatch.setattr(admission, "resolve", lambda *a, **k: calls.append(a[3]) or real(*a, **k))

    def admit(spec, n):
        r = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"vllm_hook": spec}, max_tokens=4,
                                                            skip_reading_prefix_cache=False),
                            prompt_token_ids=list(range(n)), cache_salt=None)
        admission._admit(ip, f"r{len(calls)}-{n}-{id(r)}", r)
        return r.sampling_params

    plain = {"capture": [{"layers": [1], "tokens": "all"}], "steer": [{"op": "add", "layer": 2, "vector": [0.5] * 8}]}
    got = [admit(json.loads(json.dumps(plain)), n) for n in (10, 1, 23, 10)]
    assert calls == [10]
    assert [g.extra_args["vllm_hook"]["P"] for g in got] == [10, 1, 23, 10]
    # Every prompt token is captured: a cached prefix is skipped, but a 1-token prompt has none.
    assert [g.skip_reading_prefix_cache for g in got] == [True, False, True, True]
    positional = {"capture": [{"layers": [1], "tokens": [-1]}]}
    got = [admit(json.loads(json.dumps(positional)), n) for n in (10, 23, 10)]
    assert calls == [10, 10, 23]
    assert [g.extra_args["vllm_hook"]["cap"][0]["pos"] for g in got] == [[9], [22], [9]]


def test_resolution_cache_one_resolve_per_distinct_spec():
    from types import SimpleNamespace

    from vllm_hook.frontend.admission import _admit
    from vllm_hook.frontend.state import STATE_ATTR, FrontendState
    from vllm_hook.model.layout import PointTable

    st = FrontendState(cfg=CFG, info=INFO, points=PointTable.for_config(4, CFG), max_model_len=64)
    st.names["v"] = ("d" * 32, 2.0)
    ip = SimpleNamespace()
    ip.__dict__[STATE_ATTR] = st

    def req(spec, n=10):
        return SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"vllm_hook": spec},
                                                               skip_reading_prefix_cache=False),
                               prompt_token_ids=list(range(n)), cache_salt=None)

    spec = {"steer": [{"op": "add", "layer": 1, "vector": "v", "scale": 2.0, "tokens": [-1]}]}
    a, b, c = req(dict(spec)), req(dict(spec)), req(dict(spec), n=12)
    for i, r in enumerate((a, b, c)):
        _admit(ip, str(i), r)
    wa, wb, wc = (r.sampling_params.extra_args["vllm_hook"] for r in (a, b, c))
    assert st.resolved.hits == 1                            # b; c has another prompt length
    # Each its own key and steering-only ticket (its clean mark, delivery.arena); else equal.
    assert wa["key"] != wb["key"] and wa["t"] != wb["t"] and {k: v for k, v in wa.items() if k not in ("key", "t")} == \
        {k: v for k, v in wb.items() if k not in ("key", "t")}
    kept = [r for r, _ in st.resolved._resolved.values()]
    assert all("t" not in r.wire and not r.ticket for r in kept)      # no request's own
    # n > 1: the children share the parent's wire, so no ticket (one child's clean mark must
    # not hide another's error); nor a capture (always fetched).
    e, f = req(dict(spec)), req({"capture": [{"layers": [1]}]})
    e.sampling_params.n = 2
    _admit(ip, "4", e)
    _admit(ip, "5", f)
    assert "t" not in e.sampling_params.extra_args["vllm_hook"] and "t" not in f.sampling_params.extra_args["vllm_hook"]
    assert steer_ops(wc["steer"])[0]["pos"] == [11] and steer_ops(wa["steer"])[0]["pos"] == [9]
    assert a.cache_salt == b.cache_salt                     # same steering: the same prefix-cache salt
    st.names["v"] = ("e" * 32, 2.0)
    st.resolved.clear()                                     # what (re)registering a vector does
    d = req(dict(spec))
    _admit(ip, "3", d)
    assert steer_ops(d.sampling_params.extra_args["vllm_hook"]["steer"])[0]["digest"] == "e" * 32
    # Specs that hold tensors are resolved every time (no cheap exact key).
    import torch

    from vllm_hook.frontend.cache import cache_key
    assert cache_key({"steer": [{"op": "add", "layer": 0, "vector": torch.ones(8)}]}) == (None, [])
    # Its pickler is reused: equal content, equal key, after a refusal or a large spec too;
    # different content (an int where a float was, another order), another key.
    a = {"steer": [{"op": "add", "layer": 0, "vector": "v", "scale": 1.0}]}
    key = cache_key(a)[0]
    assert key is not None and cache_key(json.loads(json.dumps(a)))[0] == key
    assert cache_key({"x": "y" * (1 << 17)}) == (None, [])
    assert cache_key(json.loads(json.dumps(a)))[0] == key
    assert cache_key({"steer": [{"op": "add", "layer": 0, "vector": "v", "scale": 1}]})[0] != key
    assert cache_key({"steer": [{"layer": 0, "op": "add", "vector": "v", "scale": 1.0}]})[0] != key


def test_sealed_spec_rides_through_vllms_copy_and_is_admitted_as_given():
    """vLLM deep-copies each request's SamplingParams: the raw spec rides through as one
    object (not copied op by op), the caller's params stay as they were, admission reads it."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_hook.frontend.admission import Sealed, _admit, sealed
    from vllm_hook.frontend.state import STATE_ATTR, FrontendState
    from vllm_hook.model.layout import PointTable

    spec = {"steer": [{"op": "add", "layer": x, "vector": "v", "scale": 1.0} for x in range(4)]}
    sp = SamplingParams(max_tokens=2, extra_args={"vllm_hook": spec, "other": [1, 2]})
    before = sp.extra_args
    with sealed(sp):
        copy = sp.clone()
    assert sp.extra_args is before and sp.extra_args["vllm_hook"] is spec
    assert isinstance(copy.extra_args["vllm_hook"], Sealed) and copy.extra_args["vllm_hook"].raw is spec
    assert copy.extra_args["other"] == [1, 2] and copy.extra_args["other"] is not before["other"]
    as_json = SamplingParams(extra_args={"vllm_hook": json.dumps(spec)})
    with sealed(as_json):                                   # a string copies cheaply: as it is
        assert isinstance(as_json.extra_args["vllm_hook"], str)
    st = FrontendState(cfg=CFG, info=INFO, points=PointTable.for_config(4, CFG), max_model_len=64)
    st.names["v"] = ("d" * 32, 2.0)
    ip = SimpleNamespace()
    ip.__dict__[STATE_ATTR] = st
    req = SimpleNamespace(sampling_params=copy, prompt_token_ids=list(range(8)), cache_salt=None)
    _admit(ip, "0", req)
    wire = copy.extra_args["vllm_hook"]
    assert isinstance(wire, dict) and len(steer_ops(wire["steer"])) == 4 and copy.extra_args["other"] == [1, 2]


def test_one_spec_object_is_keyed_once_per_call(monkeypatch):
    """Within one call that adds requests (`one_call`), a spec object passed for many prompts
    is pickled for its cache key once; a dict edited between calls is keyed again, so the
    edit takes effect; outside a call every request is keyed."""
    from types import SimpleNamespace

    from vllm_hook.frontend import admission, cache
    from vllm_hook.frontend.state import STATE_ATTR, FrontendState
    from vllm_hook.model.layout import PointTable

    st = FrontendState(cfg=CFG, info=INFO, points=PointTable.for_config(4, CFG), max_model_len=64)
    st.names["v"] = ("d" * 32, 2.0)
    ip = SimpleNamespace()
    ip.__dict__[STATE_ATTR] = st
    keyed = []
    monkeypatch.setattr(cache, "cache_key", lambda raw: keyed.append(raw) or (repr(raw), []))

    def add(spec, rid):
        r = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"vllm_hook": admission.Sealed(spec)},
                                                            skip_reading_prefix_cache=False),
                            prompt_token_ids=list(range(10)), cache_salt=None)
        admission._admit(ip, rid, r)
        return steer_ops(r.sampling_params.extra_args["vllm_hook"]["steer"])[0]["layer"]

    spec = {"steer": [{"op": "add", "layer": 1, "vector": "v", "scale": 2.0}]}
    with cache.one_call():
        assert [add(spec, str(i)) for i in range(5)] == [1] * 5
    assert len(keyed) == 1
    spec["steer"][0]["layer"] = 2                       # edited between calls
    with cache.one_call():
        assert [add(spec, f"b{i}") for i in range(3)] == [2] * 3
    assert len(keyed) == 2
    assert add(spec, "c0") == 2 and add(spec, "c1") == 2 and len(keyed) == 4


def test_size_bounds_keep_the_check_short():
    """What bounds the time one spec's check takes in the API server's event loop."""
    from vllm_hook.spec.resolve import MAX_CAPTURE_ENTRIES
    from vllm_hook.spec.schema import MAX_SPEC_CHARS, MAX_SPEC_ENTRIES

    many = {"capture": [{"layers": [0], "tokens": list(range(40))} for _ in range(MAX_SPEC_ENTRIES // 40 + 1)]}
    with pytest.raises(SpecError, match="more than 65536 in all") as e:
        parse_spec(many)
    assert e.value.where == "spec" and "selectors" in e.value.fix
    steer_many = {"steer": [{"op": "add", "layer": 0, "vector": V, "tokens": list(range(40000))}] * 2}
    with pytest.raises(SpecError, match="in all"):
        parse_spec(steer_many)
    with pytest.raises(SpecError, match="more than a spec may hold") as e:
        parse_spec(json.dumps({"steer": [{"op": "add", "layer": 0, "vector": [0.5] * (MAX_SPEC_CHARS // 4)}]}))
    assert "b64" in e.value.fix
    # Repeated items and layers are checked and sent once.
    r = R({"capture": [{"layers": [0, -4, 0, 3], "tokens": "last"}] * 500})
    assert [(c["layer"], c["sel"]) for c in r.wire["cap"]] == [(0, "last"), (3, "last")]
    assert len(r.items) == 2
    # Distinct captures are bounded.
    wide = HookConfig(sites=CFG.sites)
    big = ModelInfo(num_layers=64, hidden_size=8, name="deep")
    spec = {"capture": [{"layers": "all", "tokens": [t]} for t in range(MAX_CAPTURE_ENTRIES // 64 + 1)]}
    with pytest.raises(SpecError, match="distinct") as e:
        resolve(parse_spec(spec), big, wide, 200, {}.get)
    assert e.value.where == "capture"


def test_served_check_parses_a_spec_text_once_and_stays_bounded(monkeypatch):
    """`vllm serve` checks each request's spec text before admission: a text that passed is
    known by its digest (no second parse); a refused one is refused every time; the memory of
    passed texts is bounded."""
    from vllm_hook.server import errors

    monkeypatch.setattr(errors, "_PASSED", type(errors._PASSED)())
    monkeypatch.setattr(errors, "PASSED_MAX", 4)
    parses = []
    real = errors.parse_spec
    monkeypatch.setattr(errors, "parse_spec", lambda raw: parses.append(raw) or real(raw))
    text = json.dumps({"steer": [{"op": "add", "layer": x, "vector": "v", "scale": 0.5} for x in range(3)]})
    for _ in range(3):
        errors.check_served_spec(text)
    assert len(parses) == 1
    saving = json.dumps({"capture": [{"layers": [0]}], "save": {"dir": "/tmp/x"}})
    for _ in range(2):
        with pytest.raises(SpecError, match="not available over HTTP"):
            errors.check_served_spec(saving)
    with pytest.raises(SpecError, match="malformed JSON"):
        errors.check_served_spec("{")
    # A lone surrogate (what a JSON "\ud800" escape decodes to) is hashed, not a crash; the
    # name is judged at admission (an unknown vector).
    errors.check_served_spec('{"steer": [{"op": "add", "layer": 0, "vector": "\ud800"}]}')
    for i in range(10):
        errors.check_served_spec(json.dumps({"capture": [{"layers": [i]}]}))
    assert len(errors._PASSED) == 4
    errors.check_served_spec(text)            # pushed out by the later ones: parsed again
    assert len(parses) == 1 + 2 + 1 + 1 + 10 + 1
