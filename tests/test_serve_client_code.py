"""A server whose operator set allow_client_code: clients' pickled Python hooks run there
(remote code execution, which is why it is off by default: tests/test_serve.py). It also
serves a LoRA adapter, for the served activation oracle (examples/activation_oracle.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import vllm_hook
from tests.helpers import hf_ref
from tests.helpers.server import API_KEY, serving
from vllm_hook.testing.tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import activation_oracle  # noqa: E402

pytestmark = pytest.mark.server
P = [11, 52, 97, 140, 201, 33, 77, 260, 301, 19, 45]


ORACLE_LAYER = 1


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return activation_oracle.random_adapter(tiny_model("qwen2"), str(tmp_path_factory.mktemp("oracle-lora")))


@pytest.fixture(scope="module")
def server(engines, lora_dir):
    engines.close()             # one engine at a time on the CI box
    lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--lora-modules", f"oracle={lora_dir}"]
    with serving({"hook_layers": [1, 2], "allow_client_code": True, "projection_layers": [ORACLE_LAYER]},
                 cli_args=lora) as srv:
        yield srv


def _norms(ctx, h):
    ctx.saved.setdefault("norms", []).append(h.float().norm(dim=-1))


def test_pickled_hooks_run_when_allowed(server):
    with vllm_hook.Client(server.url, api_key=API_KEY) as client:
        assert client.health()["hooks"]["allow_client_code"] is True
        spec = {"hooks": [vllm_hook.Hook(_norms, [1]), vllm_hook.Hook(lambda c, h: h * 0.5, [2])],
                "capture": [{"layers": [1, 2]}]}
        r = client.generate(P, spec, max_tokens=4, temperature=0).results
        assert r.ok, r.errors
        assert torch.allclose(torch.cat(r.hook_results[0]["norms"]), r.activations["resid_post"][1].norm(dim=-1),
                              rtol=1e-5)
        plain = client.generate(P, {"capture": [{"layers": [2]}]}, max_tokens=1, temperature=0).results
        assert torch.allclose(r.activations["resid_post"][2][:len(P)], 0.5 * plain.activations["resid_post"][2],
                              rtol=1e-5, atol=1e-6)
        # Layers without a hook point are still refused, naming the key.
        with pytest.raises(vllm_hook.SpecError, match="hook_layers including 3"):
            client.generate(P, {"hooks": [vllm_hook.Hook(_norms, [3])]}, max_tokens=1)
        assert client.register_hooks([vllm_hook.Hook(_norms, [2])]) == 1
        client.generate(P, None, max_tokens=2, temperature=0)
        got = client.collect_hook_results()
        assert any(len(e[0]["norms"]) == 2 for e in got.values())
        client.clear_hooks()


@torch.no_grad()
def test_activation_oracle_over_http(server, lora_dir):
    """The served activation oracle: the source activation captured over HTTP, injected with
    norm_match at the placeholder by the plain openai client (the spec in vllm_xargs, the
    adapter served as model "oracle"): its greedy tokens equal HF + PEFT with the same adapter
    and op; the base model served beside it gives plain HF's tokens with the op."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    openai = pytest.importorskip("openai")
    model = tiny_model("qwen2")
    tok = AutoTokenizer.from_pretrained(model)
    with vllm_hook.Client(server.url, api_key=API_KEY) as c:
        src = c.generate(tok("The Eiffel Tower is in Paris.").input_ids,
                         {"capture": [{"layers": [ORACLE_LAYER], "tokens": "last_prompt"}]}, max_tokens=1).results
    v = src.activations["resid_post"][ORACLE_LAYER][-1]
    prompt, pos = activation_oracle.oracle_prompt(tok)
    ops = activation_oracle.injection(v, ORACLE_LAYER, pos)
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    names = [m.id for m in oc.models.list().data]
    assert "oracle" in names, names

    def ask(name):
        r = oc.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0, extra_body={
            "ignore_eos": True, "return_token_ids": True, "vllm_xargs": {"vllm_hook": json.dumps({"steer": ops})}})
        with vllm_hook.Client(server.url, api_key=API_KEY) as c:
            (res,) = c.results_of(r)
        assert res.ok, res.errors                  # every op was applied
        return list(r.choices[0].token_ids)

    oracle = PeftModel.from_pretrained(hf_ref.load.__wrapped__(model), lora_dir).base_model.model.eval()
    got = ask("oracle")
    assert got == hf_ref.greedy(oracle, prompt, 8, ops)[0]
    base = [m for m in names if m != "oracle"][0]
    plain = ask(base)
    assert plain == hf_ref.greedy(hf_ref.load(model), prompt, 8, ops)[0]
    assert plain != got                            # the adapter is what the oracle runs
