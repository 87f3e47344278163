"""vllm-lens-style arguments (`output_residual_stream`, `apply_steering_vectors` with 2-D and
3-D `SteeringVector`s) on a real engine: the same numbers as our spec, bit for bit, and as
Hugging Face transformers fp32 (max|diff| <= 1e-4 x max|ref|)."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

import vllm_hook
from tests.helpers import hf_ref
from tests.helpers.common import PROMPTS, ids_of, rel_err, res, run, sp, vec
from vllm_hook.testing.tiny_models import tiny_model

pytestmark = pytest.mark.engine
H, TOL = 128, 1e-4


@pytest.fixture
def llm(engines):
    return engines.get("qwen2-compiled", arch="qwen2")


def lens(max_tokens=6, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def _same(a, b):
    assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    ra, rb = res(a), res(b)
    for L, t in rb.activations["resid_post"].items():
        assert torch.equal(ra.activations["resid_post"][L], t), L


def test_output_residual_stream_is_a_stacked_capture(llm):
    ids = ids_of(llm, PROMPTS[0])
    got, ours = run(llm, [ids, ids], [lens(output_residual_stream=[3, 1]),
                                      sp({"capture": [{"layers": [1, 3], "tokens": "all"}]}, max_tokens=6,
                                         ignore_eos=True)])
    stream = got.activations["residual_stream"]
    assert stream.shape == (2, len(ids) + 5, H)          # layers as asked, every computed row
    assert torch.equal(stream[0], res(ours).activations["resid_post"][3])
    assert torch.equal(stream[1], res(ours).activations["resid_post"][1])
    assert torch.equal(res(got).residual_stream, res(ours).stacked())
    ref, _ = hf_ref.activations(hf_ref.load(tiny_model("qwen2")), list(got.prompt_token_ids)
                                + list(got.outputs[0].token_ids)[:-1])
    assert rel_err(stream[0], ref["resid_post"][3]) <= TOL


def _hf_ops(sv: vllm_hook.SteeringVector) -> list[dict]:
    a = torch.as_tensor(sv.activations)
    out = []
    for i, L in enumerate(sv.layer_indices):
        if a.ndim == 2:
            out.append({"op": "add", "layer": L, "vector": a[i], "scale": sv.scale,
                        "norm_match": sv.norm_match, "tokens": sv.position_indices or "all"})
        else:
            pos = sv.position_indices or list(range(a.shape[1]))
            out += [{"op": "add", "layer": L, "vector": a[i, j], "scale": sv.scale,
                     "norm_match": sv.norm_match, "tokens": [p]} for j, p in enumerate(pos)]
    return out


CASES = {
    "2d_all_tokens": vllm_hook.SteeringVector(activations=torch.stack([vec(1), vec(2)]), layer_indices=[0, 2],
                                              scale=3.0),
    "2d_positions_norm_match": vllm_hook.SteeringVector(activations=vec(3)[None], layer_indices=[1], scale=0.5,
                                                        norm_match=True, position_indices=[2, 4]),
    # a vector per position: 3 positions at a layer whose max_ops_per_layer is 2 (they share a slot)
    "3d_positions": vllm_hook.SteeringVector(activations=torch.stack([torch.stack([vec(10 + j) for j in range(3)]),
                                                                      torch.stack([vec(20 + j) for j in range(3)])]),
                                             layer_indices=[1, 3], scale=2.0, position_indices=[1, 3, 5]),
    "3d_default_positions": vllm_hook.SteeringVector(activations=torch.stack([vec(30 + j) for j in range(4)])[None],
                                                     layer_indices=[2], scale=4.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_apply_steering_vectors_equal_our_spec_and_hf(llm, name):
    sv = CASES[name]
    ids = ids_of(llm, PROMPTS[2])
    capture = {"capture": [{"layers": "all", "tokens": "all"}]}
    got, ours = run(llm, [ids, ids], [
        lens(apply_steering_vectors=[sv], vllm_hook=capture),
        sp({**capture, "steer": sv.ops()}, max_tokens=6, ignore_eos=True)])
    _same(got, ours)
    hf = hf_ref.load(tiny_model("qwen2"))
    seq = list(got.prompt_token_ids) + list(got.outputs[0].token_ids)[:-1]
    ref, _ = hf_ref.activations(hf, seq, ops=_hf_ops(sv), prompt_len=len(ids))
    for L in range(4):
        assert rel_err(res(got).activations["resid_post"][L], ref["resid_post"][L]) <= TOL, L
    ref_tokens, _ = hf_ref.greedy(hf, ids, 6, ops=_hf_ops(sv))
    assert list(got.outputs[0].token_ids) == ref_tokens


def test_steering_vectors_over_the_wire_form(llm):
    """SteeringVector.to_json (what HTTP clients send) gives the same vectors back."""
    sv = CASES["3d_positions"]
    back = vllm_hook.SteeringVector.model_validate(sv.to_json())
    assert (back.activations == sv.activations).all() and back.position_indices == sv.position_indices


@pytest.mark.parametrize("bad, words", [
    (dict(activations=torch.zeros(2, H), layer_indices=[0]), "layer_indices"),
    (dict(activations=torch.zeros(H), layer_indices=[0]), "2-D"),
    (dict(activations=torch.zeros(1, 3, H), layer_indices=[0], position_indices=[1, 2]), "position_indices"),
])
def test_bad_steering_vectors_are_refused_by_field(llm, bad, words):
    ids = ids_of(llm, PROMPTS[0])
    with pytest.raises(vllm_hook.SpecError) as e:
        run(llm, [ids], [lens(apply_steering_vectors=[bad])])
    assert "apply_steering_vectors[0]" in str(e.value) and words in str(e.value)


def test_per_position_vectors_then_a_projection_op_at_one_layer_are_refused(llm):
    """A cap after 3 per-position vectors of one slot meets a different vector on each row:
    one op row cannot hold its projection math. Before them (what the lens keys do with a
    spec's own ops: those come first), or on another layer, it runs."""
    sv = CASES["3d_positions"]
    cap = {"op": "cap", "layer": 1, "vector": vec(9).tolist(), "max": 0.5}
    ids = ids_of(llm, PROMPTS[0])
    with pytest.raises(vllm_hook.SpecError) as e:
        run(llm, [ids], [sp({"steer": sv.ops() + [cap]})])
    assert "projection op" in str(e.value) and "steer[6]" in str(e.value)
    outs = run(llm, [ids, ids], [sp({"steer": [cap] + sv.ops()}), sp({"steer": sv.ops() + [{**cap, "layer": 2}]})])
    assert all(res(o).ok for o in outs)
