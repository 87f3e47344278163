"""A bf16 engine: float32 results whose rows the workers widen on the device (wire "W",
`delivery.collector`) equal those the frontend widens, and the model-dtype rows widened,
bit for bit, whatever shares their step."""

from __future__ import annotations

import pytest
import torch

import vllm_hook

from tests.helpers.common import PROMPTS, ids_of, res, run, sp

pytestmark = pytest.mark.engine

EVERY = {"capture": [{"layers": [0, 2], "tokens": "all"}, {"layers": [1], "site": "mlp_out", "tokens": "all"}]}
LAST = {"capture": [{"layers": [0, 3], "tokens": "last_prompt"}]}
STEER = {"steer": [{"op": "add", "layer": 1, "vector": [0.01] * 128, "scale": 1.0}]}


@pytest.fixture
def llm(engines, monkeypatch):
    # An offline process: earlier tests of this one may have attached the HTTP routes to an
    # app (`server.routes.attach`), which marks the process as serving (no widening there).
    from vllm_hook.frontend.state import SERVED

    monkeypatch.setitem(SERVED, "on", False)
    return engines.get("qwen2-bf16-eager", arch="qwen2", dtype="bfloat16", enforce_eager=True)


def _widened(llm) -> int:
    return vllm_hook.stats(llm)["blocks_widened"]


def _same(wide, narrow):
    assert wide.activations.keys() == narrow.activations.keys()
    for site, layers in narrow.activations.items():
        for L, rows in layers.items():
            assert rows.dtype == torch.bfloat16 and wide.activations[site][L].dtype == torch.float32
            assert torch.equal(wide.activations[site][L], rows.float()), (site, L)
            assert torch.equal(wide.positions[site][L], narrow.positions[site][L])


def test_rows_widened_on_the_device_equal_the_model_dtypes_widened(llm):
    prompts = [ids_of(llm, PROMPTS[i % len(PROMPTS)]) for i in range(4)]
    model = {**EVERY, "dtype": "model"}
    narrow = [res(o) for o in run(llm, prompts[:3], [sp(model, max_tokens=1)] * 3)]
    # one-token requests and a steering neighbour: every block of the step widened
    before = _widened(llm)
    outs = run(llm, prompts, [sp(EVERY, max_tokens=1)] * 3 + [sp(STEER, max_tokens=1)])
    assert _widened(llm) > before
    for o, n in zip(outs[:3], narrow):
        _same(res(o), n)
    # a neighbour in the model's dtype shares the step's blocks: they stay bf16, the frontend widens
    before = _widened(llm)
    outs = run(llm, prompts[:2], [sp(EVERY, max_tokens=1), sp(model, max_tokens=1)])
    assert _widened(llm) == before
    _same(res(outs[0]), narrow[0])
    # prompt selectors: widened whatever max_tokens, the generated tokens the same
    narrow = [res(o) for o in run(llm, prompts, [sp({**LAST, "dtype": "model"}, max_tokens=5)] * 4)]
    before = _widened(llm)
    outs = run(llm, prompts, [sp(LAST, max_tokens=5)] * 4)
    assert _widened(llm) > before
    for o, n in zip(outs, narrow):
        _same(res(o), n)
        assert res(o).token_ids == n.token_ids
