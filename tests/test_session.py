"""Steering sessions (chatspace-style) on real engines: the session's steering equals the same
per-request spec bit for bit; push/pop and the context manager restore exactly; chat message
boundaries cover every token once and message activations are slices of a full capture; a
change made while a request runs (async) does not reach it and reaches the next."""

from __future__ import annotations

import asyncio

import pytest
import torch

import vllm_hook
from tests.helpers.common import PROMPTS, rel_err, res, run, sp, vec

pytestmark = pytest.mark.engine
H = 128


@pytest.fixture
def llm(engines):
    return engines.get("qwen2-compiled", arch="qwen2")


def _steered_spec():
    return [{"op": "add", "layer": 1, "vector": vec(51).tolist(), "scale": 3.0},
            {"op": "ablate", "layer": 2, "vector": vec(52).tolist(), "scale": 0.0}]


def test_session_steering_equals_the_per_request_spec(llm):
    model = vllm_hook.SteerModel(llm)
    assert (model.hidden_size, model.layer_count) == (H, 4)
    model.set_layer_vector(1, vec(51), scale=3.0)
    model.set_layer_ablation(2, vec(52))
    got = model.generate([PROMPTS[0], PROMPTS[1]], capture_layers=[1, 3], max_tokens=6, temperature=0.0,
                         ignore_eos=True)
    ids = [list(g.prompt_token_ids) for g in got]
    ref = run(llm, ids, [sp({"steer": _steered_spec(), "capture": [{"layers": [1, 3], "tokens": "all"}]},
                            max_tokens=6, ignore_eos=True)] * 2)
    plain = run(llm, ids[:1], [sp(None, max_tokens=6, ignore_eos=True)])[0]
    for g, r in zip(got, ref):
        assert g.token_ids == list(r.outputs[0].token_ids)
        assert g.activations(1).shape == (len(g.prompt_token_ids) + 5, H)
        for L in (1, 3):
            assert torch.equal(g.activations(L), res(r).activations["resid_post"][L])
    assert got[0].token_ids != list(plain.outputs[0].token_ids)      # the steering did something
    model.clear_all_vectors()
    assert model.generate(PROMPTS[0], max_tokens=6, temperature=0.0, ignore_eos=True)[0].token_ids == \
        list(plain.outputs[0].token_ids)


def test_push_pop_and_context_manager_restore_exactly(llm):
    model = vllm_hook.SteerModel(llm)
    model.set_layer_vector(1, vec(51), scale=3.0)
    before = model.export_steering_spec()
    on_top = {"steer": [{"op": "cap", "layer": 3, "vector": vec(53).tolist(), "max": 0.1},
                        {"op": "add", "layer": 1, "vector": vec(54).tolist(), "scale": -1.0}]}
    with model.steering(on_top):
        inside = model.export_steering_spec()
        out = model.generate(PROMPTS[2], max_tokens=5, temperature=0.0, ignore_eos=True)[0]
    assert model.export_steering_spec() == before
    # inside: layer 1's add replaced, layer 3's cap added
    assert [(o["layer"], o["op"]) for o in inside["steer"]] == [(1, "add"), (3, "cap")]
    ref = run(llm, [out.prompt_token_ids], [sp({"steer": inside["steer"]}, max_tokens=5, ignore_eos=True)])[0]
    assert out.token_ids == list(ref.outputs[0].token_ids)
    model.push_steering_spec(on_top)
    model.clear_layer_vector(1)
    model.pop_steering_spec()
    assert model.export_steering_spec() == before
    with pytest.raises(IndexError):
        model.pop_steering_spec()
    copy = vllm_hook.SteerModel(llm)
    copy.apply_steering_spec(before)
    assert copy.export_steering_spec() == before
    with pytest.raises(vllm_hook.SpecError, match="hidden size"):
        model.set_layer_vector(0, torch.zeros(H + 1))


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[3]}]


def test_chat_boundaries_and_message_activations(llm):
    model = vllm_hook.SteerModel(llm)
    (r,) = model.chat(CHAT, capture_layers=[2], max_tokens=4, temperature=0.0, ignore_eos=True)
    P = len(r.prompt_token_ids)
    b = r.message_boundaries
    assert [x.role for x in b] == ["system", "user", "generation_prompt"]
    assert b[0].start == 0 and b[-1].end == P and all(x.end == y.start for x, y in zip(b, b[1:]))
    full = r.activations(2)                                   # [P + 4 - 1, H], positions 0..
    assert full.shape[0] == P + 3
    assert torch.equal(r.get_message_activations(1, 2), full[b[1].start:b[1].end])
    assert torch.equal(r.get_message_activations(1, 2, include_generated=True),
                       torch.cat([full[b[1].start:b[1].end], full[P:]]))
    tok = llm.get_tokenizer()
    assert b[1].content == PROMPTS[3] and PROMPTS[3] in tok.decode(r.prompt_token_ids[b[1].start:b[1].end])
    # the same prompt offline, by its token ids, captures the same rows
    ref = run(llm, [r.prompt_token_ids], [sp({"capture": [{"layers": [2], "tokens": "all"}]}, max_tokens=4,
                                             ignore_eos=True)])[0]
    assert torch.equal(res(ref).activations["resid_post"][2], full)


def test_continue_final_message_separates_prefill_and_generated(llm):
    model = vllm_hook.SteerModel(llm)
    conv = CHAT + [{"role": "assistant", "content": "The sea"}]
    (r,) = model.chat(conv, continue_final_message=True, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert r.prefill == "The sea" and r.generated == r.text and r.full_text() == "The sea" + r.text
    assert r.to_message() == {"role": "assistant", "content": r.full_text()}
    assert r.message_boundaries[-1].role == "assistant" and r.message_boundaries[-1].end == len(r.prompt_token_ids)
    assert "The sea" in llm.get_tokenizer().decode(r.prompt_token_ids[-4:])


def test_async_session_snapshots_the_state_at_submission(engines):
    """A long request started before a change keeps its steering; the next gets the change.
    And the async session equals the sync one's numbers (same prompt, same state)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.conftest import DEFAULTS
    from vllm_hook.testing.tiny_models import tiny_model

    engines.close()                       # one engine at a time

    async def main():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=tiny_model("qwen2"), enforce_eager=True,
                                                           **DEFAULTS))
        try:
            model = vllm_hook.AsyncSteerModel(engine)
            kw = dict(max_tokens=200, temperature=0.0, ignore_eos=True, capture_layers=[2])
            model.set_layer_vector(1, vec(51), scale=3.0)
            long = asyncio.ensure_future(model.generate(PROMPTS[0], **kw))
            await asyncio.sleep(0.05)
            assert not long.done()                        # still running when the state changes
            model.set_layer_vector(1, vec(51), scale=-3.0)
            after = await model.generate(PROMPTS[0], **kw)
            model.set_layer_vector(1, vec(51), scale=3.0)
            again = await model.generate(PROMPTS[0], **kw)
            async with model.steering({"steer": [{"op": "add", "layer": 1, "vector": vec(51).tolist(),
                                                  "scale": -3.0}]}):
                inside = await model.generate(PROMPTS[0], **kw)
            return (await long)[0], after[0], again[0], inside[0], model.export_steering_spec()
        finally:
            engine.shutdown()

    first, after, again, inside, state = asyncio.run(main())
    # `first` shared its batch with `after` for a while: equal tokens, rows within fp32 batch noise
    assert first.token_ids == again.token_ids and rel_err(first.activations(2), again.activations(2)) <= 1e-5
    assert first.token_ids != after.token_ids
    assert inside.token_ids == after.token_ids and state["steer"][0]["scale"] == 3.0


def test_a_chatspace_script_runs_with_the_import_changed(engines):
    """chatspace's async API (VLLMSteeringConfig, VLLMSteerModel, SteeringSpec of AddSpec /
    ProjectionCapSpec / AblationSpec, generate/chat with steering_spec and capture handles):
    its numbers equal the same per-request spec on our session; two concurrent calls with
    different specs each get their own."""
    from tests.conftest import DEFAULTS
    from vllm_hook.session.chatspace import (AblationSpec, AddSpec, LayerSteeringSpec, ProjectionCapSpec,
                                             SteeringSpec, VLLMSteerModel, VLLMSteeringConfig)
    from vllm_hook.testing.tiny_models import tiny_model

    engines.close()
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def main():
        model = VLLMSteerModel(VLLMSteeringConfig(model_name=tiny_model("qwen2"), dtype="float32",
                                                  max_model_len=512), enforce_eager=True,
                               kv_cache_memory_bytes=DEFAULTS["kv_cache_memory_bytes"],
                               additional_config={"vllm_hook": {"projection_layers": [2]}})
        try:
            assert (model.hidden_size, model.layer_count) == (H, 4)
            v = vec(51)
            spec = VLLMSteerModel.simple_steering(1, v, scale=3.0)
            spec.layers[2] = LayerSteeringSpec([ProjectionCapSpec(vec(52) / vec(52).norm(), max=0.5),
                                                AblationSpec(vec(53) / vec(53).norm(), scale=0.0)])
            other = SteeringSpec({1: LayerSteeringSpec([AddSpec(v / v.norm(), -3.0 * float(v.norm()))])})
            (texts, handles), (texts2, _) = await asyncio.gather(
                model.generate([PROMPTS[0]], steering_spec=spec, capture_layers=[1, 3], **kw),
                model.generate([PROMPTS[0]], steering_spec=other, capture_layers=3, **kw))
            async with handles[0] as h:
                caps = h.captures
            plain = await model.generate(PROMPTS[0], **kw)
            convs = [{"role": "user", "content": PROMPTS[1]}]
            (chats, chandles) = await model.chat(convs, steering_spec=spec, capture_layers=[2], **kw)
            await model.fetch_captures_batch(chandles)
            m0 = chandles[0].get_message_activations(0, 2)
            mine = vllm_hook.AsyncSteerModel(model.llm)
            ref = await mine.generate(PROMPTS[0], capture_layers=[1, 3], steering_spec={"steer": spec.ops()}, **kw)
            return texts, texts2, caps, plain, chats, m0, chandles[0], ref[0]
        finally:
            model.shutdown()

    texts, texts2, caps, plain, chats, m0, ch, ref = asyncio.run(main())
    assert texts[0] == ref.text != plain[0] and texts2[0] != texts[0]
    for L in (1, 3):
        assert torch.equal(caps[L][0]["hidden"], ref.activations(L))
    b = ch.message_boundaries[0]
    assert (b.start_token, b.end_token) == (b.start, b.end) and torch.equal(m0, ch.captures[2][0]["hidden"][b.start:b.end])
    assert chats[0].text and chats[0].message_boundaries[-1].end == len(chats[0].prompt_token_ids)
