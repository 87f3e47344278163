"""Bad input gets a clear error before the request is queued; the engine keeps serving."""

from __future__ import annotations

import json
import math

import pytest

import vllm_hook
from tests.helpers.common import PROMPTS, ids_of, res, run, sp, vec

pytestmark = pytest.mark.engine
H = 128
GOOD = [0.1] * H


def _bad_specs():
    return {
        "malformed_json": ('{"capture": [', "malformed JSON"),
        "not_an_object": ("[1, 2]", "expected an object"),
        "unknown_field": ({"capture": [], "stear": []}, "unknown field 'stear'"),
        "unknown_op": ({"steer": [{"op": "rotate", "layer": 0, "vector": GOOD}]}, '"op": "add"'),
        "unknown_site": ({"capture": [{"site": "resid_mid"}]}, "resid_post"),
        "layer_out_of_range": ({"capture": [{"layers": [4]}]}, "out of range for a 4-layer model"),
        "negative_layer_out_of_range": ({"steer": [{"op": "add", "layer": -5, "vector": GOOD}]}, "out of range"),
        "wrong_vector_size": ({"steer": [{"op": "add", "layer": 0, "vector": [1.0] * 12}]}, "expected 128 values"),
        "nan_vector": ({"steer": [{"op": "add", "layer": 0, "vector": [math.nan] * H}]}, "NaN"),
        "inf_vector": ({"steer": [{"op": "add", "layer": 0, "vector": [math.inf] + [0.0] * (H - 1)}]}, "infinite"),
        "nan_scale": ({"steer": [{"op": "add", "layer": 0, "vector": GOOD, "scale": math.nan}]}, "scale"),
        "bad_selector": ({"capture": [{"tokens": "middle"}]}, "last_prompt"),
        "position_before_prompt": ({"capture": [{"tokens": [-1000]}]}, "before the start"),
        "unknown_vector_name": ({"steer": [{"op": "add", "layer": 0, "vector": "no_such"}]}, "no registered vector"),
        "zero_vector_ablate": ({"steer": [{"op": "ablate", "layer": 0, "vector": [0.0] * H}]}, "zero norm"),
        "too_many_ops_per_layer": ({"steer": [{"op": "add", "layer": 0, "vector": GOOD}] * 3}, "max_ops_per_layer"),
        "head_out_of_range": ({"capture": [{"site": "attn_scores", "layers": [0], "heads": [4]}]}, "head 4 is out of range"),
        "kv_head_out_of_range": ({"capture": [{"site": "k", "heads": [2]}]}, "this layer has 2 heads"),
        "heads_on_residual_site": ({"capture": [{"site": "resid_post", "heads": [0]}]}, "heads applies to"),
        "heads_dict_missing_layer": ({"capture": [{"site": "q", "layers": [0, 1], "heads": {"0": [1]}}]}, "no heads listed for layer 1"),
        "attn_scores_generated_queries": ({"capture": [{"site": "attn_scores", "tokens": "generated"}]}, "must be prompt tokens"),
    }


@pytest.fixture
def llm(engines):
    return engines.get("qwen2-compiled", arch="qwen2")


@pytest.mark.parametrize("case", list(_bad_specs()))
def test_bad_spec_is_refused_and_engine_serves_on(llm, case):
    spec, words = _bad_specs()[case]
    ids = ids_of(llm, PROMPTS[0])
    with pytest.raises(ValueError) as e:
        run(llm, [ids], [sp(spec)])
    msg = str(e.value)
    assert "vllm_hook spec error" in msg and "Fix:" in msg and words in msg, msg
    good = run(llm, [ids], [sp({"capture": [{"layers": [1], "tokens": "last_prompt"}]}, max_tokens=3)])[0]
    assert res(good).activations["resid_post"][1].shape == (1, H)


def test_one_bad_request_in_a_batch_fails_the_call_not_the_engine(llm):
    ids = ids_of(llm, PROMPTS[1])
    with pytest.raises(ValueError, match="expected 128 values"):
        run(llm, [ids, ids], [sp({"capture": [{"layers": [0]}]}),
                              sp({"steer": [{"op": "add", "layer": 0, "vector": [1.0]}]})])
    # The already-added first request was aborted; nothing is left behind on the workers.
    out = run(llm, [ids], [sp({"capture": [{"layers": [0]}]}, max_tokens=2)])[0]
    assert res(out).activations["resid_post"][0].shape[0] == len(ids) + 1
    s = vllm_hook.stats(llm)
    assert s["active"] <= 1 and s["results_waiting"] == 0
    # Delivery timing, summed over fetches, on both sides.
    assert s["timing"]["fetches"] >= 1 and s["timing"]["fetch_s"] > 0
    assert s["frontend"]["fetches"] >= 1 and s["frontend"]["fetch_rpc_s"] > 0 and s["frontend"]["build_s"] > 0


def test_registered_vectors_are_checked(llm):
    with pytest.raises(ValueError, match="expected 128 values"):
        vllm_hook.register_vectors(llm, {"short": [1.0, 2.0]})
    with pytest.raises(ValueError, match="invalid vector name"):
        vllm_hook.register_vectors(llm, {"bad name!": GOOD})
    assert "calm" in vllm_hook.register_vectors(llm, {"calm": vec(5)})
    ids = ids_of(llm, PROMPTS[2])
    by_name = run(llm, [ids], [sp({"steer": [{"op": "add", "layer": 1, "vector": "calm", "scale": 5.0}]})])[0]
    inline = run(llm, [ids], [sp({"steer": [{"op": "add", "layer": 1, "vector": vec(5).tolist(), "scale": 5.0}]})])[0]
    assert list(by_name.outputs[0].token_ids) == list(inline.outputs[0].token_ids)
    vllm_hook.delete_vectors(llm, ["calm"])
    with pytest.raises(vllm_hook.UnknownVectorError):
        run(llm, [ids], [sp({"steer": [{"op": "add", "layer": 1, "vector": "calm"}]})])


def test_results_of_a_request_without_spec(llm):
    out = run(llm, [ids_of(llm, PROMPTS[0])], [sp(None, max_tokens=2)])[0]
    with pytest.raises(LookupError, match="no vllm_hook results"):
        vllm_hook.results(out)


def test_bad_engine_config_is_refused_at_construction():
    from vllm import LLM

    from vllm_hook.testing.tiny_models import tiny_model

    with pytest.raises(ValueError, match="max_ops_per_layer"):
        LLM(tiny_model("qwen2"), additional_config={"vllm_hook": {"max_ops_per_layer": 0}})
    with pytest.raises(ValueError, match="max_opps: unknown setting. Fix: did you mean .*'max_ops_per_layer'"):
        LLM(tiny_model("qwen2"), additional_config={"vllm_hook": {"max_opps": 1}})


def test_spec_as_json_string_equals_dict(llm):
    ids = ids_of(llm, PROMPTS[3])
    spec = {"capture": [{"layers": [2], "tokens": "all"}]}
    a = res(run(llm, [ids], [sp(spec)])[0])
    b = res(run(llm, [ids], [sp(json.dumps(spec))])[0])
    assert (a.activations["resid_post"][2] == b.activations["resid_post"][2]).all()
