"""A vLLM-Hook-style script on a real engine: `HookLLM` with vLLM-Hook's worker names, config
files and analyzer names. Both storage paths give the same analyze() numbers, equal to our
analyzers on the same requests; two runs into one folder keep both; the steering worker equals
the per-request spec; use_hook=False runs plainly."""

from __future__ import annotations

import json

import pytest
import torch

import vllm_hook
from tests.helpers.common import PROMPTS, res, run, sp, vec
from vllm_hook import analyzers as A

pytestmark = pytest.mark.engine
HEADS = [[0, 1], [2, 0], [2, 3], [3, 2]]
INSTRUCTION = "Summarize the text."


@pytest.fixture
def llm(engines):
    return engines.get("qwen2-compiled", arch="qwen2")


def _config(tmp_path, name, body) -> str:
    path = tmp_path / "model_configs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model_info": {"name": "tiny"}, **body}))
    return str(path)


def test_attention_tracker_script_both_storage_paths(llm, tmp_path):
    cfg = _config(tmp_path, "attention_tracker/tiny.json",
                  {"params": {"important_heads": HEADS}, "hookq": {"hookq_mode": "last_token"}})
    hl = vllm_hook.HookLLM("tiny", worker_name="probe_hook_qk", analyzer_name="attn_tracker",
                           config_file=cfg, hook_dir=tmp_path / "runs", llm=llm)
    tracker = A.AttentionTracker(important_heads=HEADS, instruction=INSTRUCTION)
    built = [tracker.prompt(hl.tokenizer, PROMPTS[i]) for i in (0, 1)]
    prompts = [{"prompt_token_ids": b.token_ids} for b in built]
    P = [len(b.token_ids) for b in built]
    # vLLM-Hook's input_range: (instruction, data), a negative bound counted from the end.
    ranges = [(b.spans["instruction"], (b.spans["data"][0] - n, b.spans["data"][1] - n)) for b, n in zip(built, P)]

    outs = hl.generate(prompts, temperature=0.0, max_tokens=2)
    in_memory = hl.analyze(analyzer_spec={"input_range": ranges})
    direct = [tracker.analyze(vllm_hook.results(o), b.spans).focus_score for o, b in zip(outs, built)]
    assert in_memory["score"] == direct and len(direct) == 2

    hl.generate(prompts, temperature=0.0, max_tokens=2, save_to_disk=True, run_id="first")
    assert hl.analyze(analyzer_spec={"input_range": ranges})["score"] == direct
    hl.generate(prompts[:1], temperature=0.0, max_tokens=2, save_to_disk=True)     # a generated run id
    assert len(hl.runs()) == 2 and "first" in hl.runs()
    assert hl.analyze(analyzer_spec={"input_range": ranges[0]})["score"] == direct[:1]
    assert hl.analyze(analyzer_spec={"input_range": ranges}, run_id="first")["score"] == direct
    assert sorted(p.name for p in (tmp_path / "runs" / "first").iterdir()) == \
        ["00000.safetensors", "00001.safetensors", "run.json"]
    with pytest.raises(ValueError, match="exists: pass another run_id"):
        hl.generate(prompts[:1], temperature=0.0, max_tokens=2, save_to_disk=True, run_id="first")
    with pytest.raises(ValueError, match="input_range has 1 entries for 2 prompts"):
        hl.analyze(analyzer_spec={"input_range": ranges[:1]}, run_id="first")
    plain = hl.generate(prompts[:1], temperature=0.0, max_tokens=2, use_hook=False)[0]
    assert plain.outputs[0].token_ids
    assert hl.analyze(analyzer_spec={"input_range": ranges[0]})["score"] == direct[:1]   # still the last hooked run


def test_steering_and_hidden_state_workers(llm, tmp_path):
    v = vec(51)
    torch.save(v, tmp_path / "vec.pt")
    cfg = _config(tmp_path, "activation_steer/tiny.json",
                  {"steering": {"method": "add_vector", "coefficient": 3.0, "optimal_layer": 1,
                                "vector_path": "../../vec.pt", "apply_at_all_positions": True}})
    steer = vllm_hook.HookLLM("tiny", worker_name="steer_hook_act", config_file=cfg, llm=llm)
    tok = llm.get_tokenizer()
    ids = tok(PROMPTS[2]).input_ids
    got = steer.generate({"prompt_token_ids": ids}, temperature=0.0, max_tokens=6, ignore_eos=True)[0]
    ref = run(llm, [ids], [sp({"steer": [{"op": "add", "layer": 1, "vector": v.tolist(), "scale": 3.0}]},
                              max_tokens=6, ignore_eos=True)])[0]
    plain = run(llm, [ids], [sp(None, max_tokens=6, ignore_eos=True)])[0]
    assert list(got.outputs[0].token_ids) == list(ref.outputs[0].token_ids) != list(plain.outputs[0].token_ids)
    off = steer.generate({"prompt_token_ids": ids}, temperature=0.0, max_tokens=6, ignore_eos=True, use_hook=False)
    assert list(off[0].outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    assert steer.analyze() is None                               # no analyzer configured

    cfg = _config(tmp_path, "hidden_states/tiny.json", {"hidden_states": {"layers": [1, 3], "mode": "all_tokens"}})
    hs = vllm_hook.HookLLM("tiny", worker_name="probe_hook_hs", analyzer_name="hidden_states",
                           config_file=cfg, llm=llm)
    out = hs.generate({"prompt_token_ids": ids}, temperature=0.0, max_tokens=2)[0]
    r = res(out)
    got = hs.analyze(analyzer_spec={"reduce": "mean"})["hidden_states"]
    assert sorted(got) == [1, 3] and r.activations["resid_post"][1].shape[0] == len(ids)
    assert torch.equal(got[3][0], r.activations["resid_post"][3].mean(0))

    with pytest.raises(ValueError, match="unknown worker_name 'probe_hook_x'"):
        vllm_hook.HookLLM("tiny", worker_name="probe_hook_x", llm=llm)
    bad = _config(tmp_path, "activation_steer/bad.json", {"steering": {"method": "adjust_rs", "optimal_layer": 1,
                                                                      "vector_path": str(tmp_path / "vec.pt")}})
    with pytest.raises(ValueError, match="steering.target"):
        vllm_hook.HookLLM("tiny", worker_name="steer_hook_act", config_file=bad, llm=llm)
