"""Hostile batch neighbours: one client's request never changes another's results.

The control keeps the batch composition fixed (MIA's lesson: a changed composition moves
numbers by itself): the same batch with a benign request in the hostile one's slot, every
request generating the same number of tokens. Good neighbours must then be bit-identical,
tokens and captures, and so must plain requests run after it (a request that left non-finite
values in its KV blocks would poison the requests that reuse them).
"""

from __future__ import annotations

import math

import pytest
import torch

import vllm_hook
from vllm_hook.spec.resolve import ModelInfo, steer_bound
from tests.helpers.common import PROMPTS, ids_of, res, run, runtime, sp, vec

pytestmark = pytest.mark.engine
H = 128


@pytest.fixture
def llm(engines):
    return engines.get("qwen2-compiled", arch="qwen2")


def _good_specs():
    return [{"capture": [{"layers": "all", "tokens": "all"}]},
            {"steer": [{"op": "add", "layer": 1, "vector": vec(61).tolist(), "scale": 3.0}],
             "capture": [{"layers": [2], "tokens": "all"}]},
            {"capture": [{"layers": [0, 3], "tokens": "last"}]}]


def _batch(llm, middle_spec, middle_prompt, n=10):
    """[good, middle, good, good], every request generating exactly n tokens."""
    goods = _good_specs()
    prompts = [ids_of(llm, PROMPTS[0]), middle_prompt, ids_of(llm, PROMPTS[2]), ids_of(llm, PROMPTS[3])]
    specs = [goods[0], middle_spec, goods[1], goods[2]]
    return run(llm, prompts, [sp(s, max_tokens=n, ignore_eos=True) for s in specs])


def _later(llm):
    """Plain requests of 3 to 33 tokens: they reuse the KV blocks just freed."""
    ids = ids_of(llm, " ".join(PROMPTS))
    return [list(o.outputs[0].token_ids) for o in
            run(llm, [ids[:n] for n in (3, 7, 12, 18, 24, 33, 5)], [sp(None, max_tokens=6)] * 7)]


def _assert_same_goods(a, b):
    for i in (0, 2, 3):
        assert list(a[i].outputs[0].token_ids) == list(b[i].outputs[0].token_ids), i
        ra, rb = res(a[i]), res(b[i])
        for site in rb.activations:
            for L in rb.activations[site]:
                assert torch.equal(ra.activations[site][L], rb.activations[site][L]), (i, site, L)
                assert torch.equal(ra.positions[site][L], rb.positions[site][L])


BIG = [3e38] + [0.0] * (H - 1)
OVERFLOWING = {
    # finite in float64, so math.isfinite passed; overflows float32 on the device
    "scale_1e39": ({"steer": [{"op": "add", "layer": 1, "vector": vec(1).tolist(), "scale": 1e39}]},
                   "steer[0].scale", "exceeds"),
    "values_near_fp32_max": ({"steer": [{"op": "add", "layer": 1, "vector": [3e38] * H}]},
                             "steer[0].scale", "exceeds"),
    "finite_but_huge_add": ({"steer": [{"op": "add", "layer": 0, "vector": BIG, "scale": 1.0}]},
                            "steer[0].scale", "exceeds"),
    "scale_1e30": ({"steer": [{"op": "add", "layer": 2, "vector": vec(2).tolist(), "scale": 1e30}]},
                   "steer[0].scale", "exceeds"),
    "norm_match_1e30": ({"steer": [{"op": "add", "layer": 2, "vector": vec(2).tolist(), "scale": 1e30,
                                    "norm_match": True}]}, "steer[0].scale", "exceeds"),
    "cap_min_1e30": ({"steer": [{"op": "cap", "layer": 2, "vector": vec(2).tolist(), "min": 1e30}]},
                     "steer[0].min", "exceeds"),
    "position_2_pow_63": ({"steer": [{"op": "add", "layer": 0, "vector": vec(3).tolist(),
                                      "tokens": [2 ** 63]}]}, "steer[0].tokens", "max_model_len"),
    "position_minus_2_pow_63": ({"steer": [{"op": "add", "layer": 0, "vector": vec(3).tolist(),
                                            "tokens": [-2 ** 63]}]}, "steer[0].tokens[0]", "before the start"),
    "position_1e30": ({"steer": [{"op": "add", "layer": 0, "vector": vec(3).tolist(), "tokens": [1e30]}]},
                      "steer[0].tokens[0]", "expected an integer"),
    "capture_position_1e30": ({"capture": [{"tokens": [1e30]}]}, "capture[0].tokens[0]", "expected an integer"),
    "layer_true": ({"capture": [{"layers": [True]}]}, "capture[0].layers[0]", "expected an integer"),
    "layer_float": ({"steer": [{"op": "add", "layer": 1.0, "vector": vec(3).tolist()}]},
                    "steer[0].layer", "expected an integer"),
    "scale_string": ({"steer": [{"op": "add", "layer": 1, "vector": vec(3).tolist(), "scale": "2"}]},
                     "steer[0].scale", "expected a number"),
    "nested_json": ("[" * 10000 + "]" * 10000, "spec", "nested too deeply"),
}


@pytest.mark.parametrize("case", list(OVERFLOWING))
def test_a_bad_request_in_a_batch_is_refused_by_prompt_index(llm, case):
    spec, where, words = OVERFLOWING[case]
    ids = ids_of(llm, PROMPTS[1])
    good = sp({"capture": [{"layers": [1], "tokens": "last_prompt"}]}, max_tokens=3)
    with pytest.raises(vllm_hook.SpecError) as e:
        run(llm, [ids, ids, ids], [good, sp(spec), good])
    assert e.value.where == f"prompts[1].{where}", str(e.value)
    assert words in str(e.value) and "Fix:" in str(e.value)
    # Nothing of the call ran, nothing is left behind, and the engine serves on.
    s = vllm_hook.stats(llm)
    assert s["active"] == 0 and s["results_waiting"] == 0
    assert res(run(llm, [ids], [good])[0]).activations["resid_post"][1].shape == (1, H)


def test_runaway_ops_stay_in_their_own_rows(llm):
    """An ablate that multiplies the stream by 1e15 twice a layer is accepted (its scale is
    representable) but runs away: the plugin clamps each op's update (`steer_bound`), so its
    own rows stay finite and bounded, and nothing reaches anyone else, in its batch or in the
    KV blocks later requests reuse."""
    ids = ids_of(llm, PROMPTS[4])
    hostile = {"steer": [{"op": "ablate", "layer": L, "vector": vec(70 + L).tolist(), "scale": 1e15}
                         for L in range(4)] * 2,
               "capture": [{"layers": "all", "tokens": "all"}]}
    benign = {"steer": [{"op": "ablate", "layer": L, "vector": vec(70 + L).tolist(), "scale": 1.0}
                        for L in range(4)] * 2,
              "capture": [{"layers": "all", "tokens": "all"}]}
    before = _later(llm)
    a = _batch(llm, hostile, ids)
    after_a = _later(llm)
    b = _batch(llm, benign, ids)
    after_b = _later(llm)
    _assert_same_goods(a, b)
    assert after_a == after_b == before
    r = res(a[1])
    top = max(float(t.abs().max()) for t in r.activations["resid_post"].values())
    # Unclamped, this request's stream reached 3.4e29 (measured); clamped, each of the 8 ops
    # moves it by at most steer_bound.
    bound = steer_bound(ModelInfo(num_layers=4, hidden_size=H, dtype="float32"), 2)
    assert 1e6 < top <= 8 * bound * 1.01
    assert all(torch.isfinite(t).all() for t in r.activations["resid_post"].values())


def _poison_admission(rt, monkeypatch, prompt_len, where):
    """Fault injection: requests of `prompt_len` tokens fail in `where` on the worker."""
    if where == "admission":
        import vllm_hook.worker.runtime as runtime_mod

        orig = runtime_mod.check_wire

        def check(wire, *a, **kw):
            if int(wire["P"]) == prompt_len:
                raise RuntimeError("injected admission failure")
            return orig(wire, *a, **kw)

        monkeypatch.setattr(runtime_mod, "check_wire", check)
        return
    from vllm_hook.routing import RequestRoutes, SteerRoute

    orig_admit = rt._admit

    def admit(req_id, wire):
        orig_admit(req_id, wire)
        req = rt.requests[req_id]
        if req.prompt_len == prompt_len:      # a route whose column is out of any table
            req.routes = RequestRoutes(req.prompt_len, (SteerRoute(10 ** 9, 1, "all"),) + req.routes.steer,
                                       req.routes.capture)
            req.horizon = math.inf
            rt.active[req_id] = req

    monkeypatch.setattr(rt, "_admit", admit)


@pytest.mark.parametrize("where", ["admission", "routing"])
def test_a_worker_failure_costs_only_its_request(llm, monkeypatch, where):
    taken = {len(ids_of(llm, PROMPTS[i])) for i in (0, 2, 3)}
    ids = ids_of(llm, PROMPTS[5])
    ids = ids[:next(n for n in range(len(ids), 0, -1) if n not in taken)]   # its length is its mark
    spec = {"steer": [{"op": "add", "layer": 2, "vector": vec(80).tolist(), "scale": 2.0}],
            "capture": [{"layers": [1], "tokens": "all"}]}
    control = _batch(llm, spec, ids)
    _poison_admission(runtime(llm), monkeypatch, len(ids), where)
    faulty = _batch(llm, spec, ids)
    _assert_same_goods(faulty, control)
    r = vllm_hook.results(faulty[1], strict=False)
    assert not r.ok and any(f"internal error in vllm_hook {'bookkeeping' if where == 'admission' else 'routing'}"
                            in e for e in r.errors), r.errors
    with pytest.raises(vllm_hook.HookRuntimeError):
        vllm_hook.results(faulty[1])
    monkeypatch.undo()
    again = _batch(llm, spec, ids)
    _assert_same_goods(again, control)
    assert list(again[1].outputs[0].token_ids) == list(control[1].outputs[0].token_ids)
    assert res(again[1]).ok


def test_steer_only_failure_on_the_worker_is_reported(llm):
    """A named vector deleted between admission and scheduling: the request runs unsteered,
    and says so (it used to return ok with no trace)."""
    from vllm_hook.frontend.delivery import attach
    from vllm_hook.frontend.state import state_of

    eng = llm.llm_engine
    ids = ids_of(llm, PROMPTS[6])
    vllm_hook.register_vectors(llm, {"fleeting": vec(90)})
    eng.add_request("fleeting-1", {"prompt_token_ids": ids},
                    sp({"steer": [{"op": "add", "layer": 1, "vector": "fleeting", "scale": 4.0}]}, max_tokens=4))
    vllm_hook.delete_vectors(llm, ["fleeting"])
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    attach(state_of(eng.input_processor), done, llm.collective_rpc)
    r = vllm_hook.results(done[0], strict=False)
    assert not r.ok and any("not registered" in e and "steering not applied" in e for e in r.errors), r.errors


def test_a_failing_fetch_keeps_every_output(llm, monkeypatch):
    rt = runtime(llm)

    def broken(*a, **k):
        raise OSError("injected fetch failure")

    monkeypatch.setattr(rt, "fetch", broken)
    ids = ids_of(llm, PROMPTS[7])
    outs = run(llm, [ids, ids], [sp({"capture": [{"layers": [0]}]}, max_tokens=4), sp(None, max_tokens=4)])
    monkeypatch.undo()
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    r = vllm_hook.results(outs[0], strict=False)
    assert r.token_ids == ids + list(outs[0].outputs[0].token_ids)
    assert any("could not be fetched" in e and "injected fetch failure" in e for e in r.errors)
    assert res(run(llm, [ids], [sp({"capture": [{"layers": [0]}]}, max_tokens=2)])[0]).ok
    # The frontend discarded what it could not fetch: nothing waits on the workers.
    assert vllm_hook.stats(llm)["results_waiting"] == 0


@pytest.mark.parametrize("where", ["batch layout", "scheduler output"])
def test_a_changed_vllm_internal_turns_the_plugin_off_not_the_engine(llm, monkeypatch, where):
    """The runner wrappers read vLLM internals on every step: when one no longer reads (an
    attribute renamed in a new release, simulated), the engine step goes on, the plugin turns
    itself off on the worker with the reason logged and in every affected request's results,
    and nothing is steered any more."""
    from vllm_hook.adapters import common, v1

    rt = runtime(llm)
    ids = ids_of(llm, PROMPTS[4])
    steer = {"steer": [{"op": "add", "layer": 1, "vector": vec(33).tolist(), "scale": 6.0}]}
    capture = {"capture": [{"layers": [2], "tokens": "all"}]}
    plain_tokens = list(run(llm, [ids], [sp(None, max_tokens=6)])[0].outputs[0].token_ids)

    def renamed(*a, **k):
        raise AttributeError("'InputBatch' object has no attribute 'num_reqs'")

    monkeypatch.setattr(v1, "_view", renamed) if where == "batch layout" else monkeypatch.setattr(
        common, "events", renamed)
    try:
        outs = run(llm, [ids] * 3, [sp(steer, max_tokens=6), sp(capture, max_tokens=6), sp(None, max_tokens=6)])
        assert all(list(o.outputs[0].token_ids) == plain_tokens for o in outs)   # nothing steered
        for o in outs[:2]:
            r = vllm_hook.results(o, strict=False)
            assert any("turned itself off" in e and "AttributeError" in e for e in r.errors), r.errors
            with pytest.raises(vllm_hook.HookRuntimeError):
                vllm_hook.results(o)
        assert rt.off and where in rt.off
        monkeypatch.undo()
        # Off for good on this worker: a later request runs unhooked, and says so.
        later = run(llm, [ids], [sp(steer, max_tokens=6)])[0]
        assert list(later.outputs[0].token_ids) == plain_tokens
        assert "turned itself off" in vllm_hook.results(later, strict=False).errors[0]
    finally:
        monkeypatch.undo()
        rt.off = None            # the shared test engine goes on with the plugin on
    assert res(run(llm, [ids], [sp(capture, max_tokens=2)])[0]).ok
