"""The bad-input corpus (corpus.py) offline: every spec is refused with a SpecError naming
the field and the fix, every bad vector body too, and the engine then serves a request with
results equal, bit for bit, to the same request before the corpus. (Over HTTP, with
statuses and hostile neighbours: tests/test_serve.py::test_bad_input_corpus_over_http.)"""

from __future__ import annotations

import json

import pytest
import torch

import vllm_hook
from tests.helpers.common import PROMPTS, ids_of, res, run, sp, vec
from tests.reliability import corpus

pytestmark = pytest.mark.engine
# What offline allows or runs differently: a save path is the user's own; pickled hooks run
# offline; hooks need an engine with hook layers (tests/test_hooks.py); this engine's capture
# bound is the default.
NOT_OFFLINE = {"save_over_http", "save_path_traversal", "hook_pickle_without_client_code",
               "hook_unknown_operator", "hook_name_number", "hook_args_not_object", "hook_item_string",
               "capture_bytes_over_the_limit"}


@pytest.fixture
def llm(engines):
    return engines.get("qwen2-compiled", arch="qwen2")


def test_bad_input_corpus_offline(llm):
    ids = ids_of(llm, PROMPTS[1])
    good = {"steer": [{"op": "add", "layer": 1, "vector": vec(5).tolist(), "scale": 2.0}],
            "capture": [{"layers": "all", "tokens": "all"}]}
    before = run(llm, [ids], [sp(good, max_tokens=6)])[0]
    wrong, tried = [], 0
    for name, (spec, status, words) in corpus.SPECS.items():
        if name in NOT_OFFLINE:
            continue
        tried += 1
        if name == "spec_too_long":     # the character bound is on JSON text (a dict is not parsed)
            spec = json.dumps(spec)
        try:
            run(llm, [ids, ids], [sp(None, max_tokens=2), sp(spec, max_tokens=2)])
            wrong.append(f"{name}: accepted")
            continue
        except vllm_hook.SpecError as e:
            msg = str(e)
            if status == 404 and not isinstance(e, vllm_hook.UnknownVectorError):
                wrong.append(f"{name}: {type(e).__name__}, want UnknownVectorError")
        left = vllm_hook.stats(llm)
        if left["active"] or left["results_waiting"]:     # a refused call leaves nothing behind
            wrong.append(f"{name}: left active={left['active']} waiting={left['results_waiting']}")
            break
        missing = [w for w in words + ["Fix:", "prompts[1]."] if w not in msg]
        if missing:
            wrong.append(f"{name}: missing {missing}: {msg[:300]}")
    for name, (body, status, words) in corpus.VECTORS.items():
        tried += 1
        try:
            vllm_hook.register_vectors(llm, body)
            wrong.append(f"{name}: accepted")
        except vllm_hook.SpecError as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                wrong.append(f"{name}: missing {missing}: {str(e)[:300]}")
    print(f"\n[corpus offline] {tried} inputs refused with a SpecError; {len(wrong)} wrong")
    assert not wrong, "\n".join(wrong)
    after = run(llm, [ids], [sp(good, max_tokens=6)])[0]
    assert list(after.outputs[0].token_ids) == list(before.outputs[0].token_ids)
    for L, t in res(before).activations["resid_post"].items():
        assert torch.equal(res(after).activations["resid_post"][L], t)
    assert vllm_hook.stats(llm)["results_waiting"] == 0
