"""The same hooks in every execution mode: compiled (Inductor) vs eager, and the default
multi-process engine (workers in other processes, results over vLLM's RPC), via the demo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.common import PROMPTS, ids_of, rel_err, res, run, sp, vec

pytestmark = pytest.mark.engine
SPEC = {"steer": [{"op": "add", "layer": 1, "vector": vec(51).tolist(), "scale": 4.0},
                  {"op": "cap", "layer": 2, "vector": vec(52).tolist(), "min": -0.1, "max": 0.1}],
        "capture": [{"layers": "all", "tokens": "all"},
                    {"layers": [0, 3], "site": "attn_out"}, {"layers": [1], "site": "mlp_out"}]}


def _run(llm):
    prompts = [ids_of(llm, p) for p in PROMPTS[:3]]
    return run(llm, prompts, [sp(SPEC, max_tokens=10), sp(None, max_tokens=10), sp(SPEC, max_tokens=5)])


def test_compiled_equals_eager(engines):
    """Also: an engine with steering compiled in only where SPEC steers (steer_layers,
    projection_layers) gives the same results, and refuses steering elsewhere."""
    compiled = _run(engines.get("qwen2-compiled", arch="qwen2"))
    c = [(list(o.outputs[0].token_ids), getattr(o, "vllm_hook", None)) for o in compiled]
    eager_llm = engines.get("qwen2-eager", arch="qwen2", enforce_eager=True, additional_config={
        "vllm_hook": {"steer_layers": [1], "projection_layers": [2]}})
    with pytest.raises(ValueError, match="steer_layers"):
        run(eager_llm, [ids_of(eager_llm, PROMPTS[0])],
            sp({"steer": [{"op": "add", "layer": 0, "vector": vec(51).tolist()}]}, max_tokens=2))
    eager = _run(eager_llm)
    for (ctoks, cres), e in zip(c, eager):
        assert ctoks == list(e.outputs[0].token_ids)
        if cres is None:
            continue
        eres = res(e)
        for site in cres.activations:
            for L in cres.activations[site]:
                assert rel_err(eres.activations[site][L], cres.activations[site][L]) <= 1e-5


def test_demo_multiprocess_engine():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run([sys.executable, "-m", "vllm_hook.demo", "--eager"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "resid_post layer 0: (1, 128) float32" in out, out
    assert "resid_post layer 3: (12, 128) float32" in out, out      # last prompt token + 11 generated
    assert "run alone without the plugin's help: True" in out, out
    assert "requests only: [False, False, True, True]" in out, out


def test_offline_fetch_sent_at_the_last_step_multiprocess(engines):
    """Issue 17: with the engine core in its own process (vLLM's default), an offline call's
    fetch leaves as its last step comes back, before vLLM processes that step: the same
    results bit for bit, in one RPC; a call failing after it hands back what it took
    (tests/helpers/early_fetch.py)."""
    engines.close()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.early_fetch"], env=env, capture_output=True,
                          text=True, timeout=900, cwd=str(Path(__file__).resolve().parents[1]))
    assert proc.returncode == 0 and "EARLY-FETCH-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
