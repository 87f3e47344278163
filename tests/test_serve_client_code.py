"""A server whose operator set allow_client_code: clients' pickled Python hooks run there
(remote code execution, which is why it is off by default: tests/test_serve.py)."""

from __future__ import annotations

import pytest
import torch

import vllm_hook
from tests.helpers.server import API_KEY, serving

pytestmark = pytest.mark.server
P = [11, 52, 97, 140, 201, 33, 77, 260, 301, 19, 45]


@pytest.fixture(scope="module")
def server(engines):
    engines.close()             # one engine at a time on the CI box
    with serving({"hook_layers": [1, 2], "allow_client_code": True}) as srv:
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
