"""Shared real vLLM engines for the tests (one alive at a time: a 2-core CI box)."""

from __future__ import annotations

import gc
import os

# In-process engine: starts in seconds (eager) and lets tests reach the scheduler.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# Tests exercise every feature, so engines enable the opt-in sites and projection ops
# everywhere (the default engine config is lean: see docs/config.md).
FULL_HOOK_CONFIG = {"sites": ["resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k"],
                    "projection_layers": "all"}
DEFAULTS = dict(
    additional_config={"vllm_hook": FULL_HOOK_CONFIG},
    dtype="float32",
    max_model_len=512,
    max_num_seqs=16,
    kv_cache_memory_bytes=64 << 20,
    logprobs_mode="raw_logits",
    seed=0,
)


class EnginePool:
    """Keeps the most recently requested engine alive; starting another shuts it down."""

    def __init__(self):
        self.name = None
        self.llm = None

    def get(self, name: str, arch: str = "qwen2", **kwargs):
        if self.name == name:
            return self.llm
        self.close()
        from vllm import LLM

        from vllm_hook.testing.tiny_models import tiny_model

        hook = {**FULL_HOOK_CONFIG, **(kwargs.pop("additional_config", {}) or {}).get("vllm_hook", {})}
        self.llm = LLM(tiny_model(arch), **{**DEFAULTS, **kwargs, "additional_config": {"vllm_hook": hook}})
        self.name = name
        return self.llm

    def close(self):
        if self.llm is None:
            return
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        self.llm = None
        self.name = None
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


_POOL = EnginePool()


@pytest.fixture(scope="session")
def engines():
    yield _POOL
    _POOL.close()


def scheduler_of(llm):
    """The in-process scheduler (tests only: to count preemptions)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


class counting_preemptions:
    """`with counting_preemptions(llm) as n:` ... `n["n"]` preemptions the scheduler made."""

    def __init__(self, llm):
        self.sched = scheduler_of(llm)
        self.count = {"n": 0}

    def __enter__(self) -> dict:
        orig = self.orig = self.sched._preempt_request

        def counting(*a, **k):
            self.count["n"] += 1
            return orig(*a, **k)

        self.sched._preempt_request = counting
        return self.count

    def __exit__(self, *exc) -> None:
        self.sched._preempt_request = self.orig


def preempted_then_alone(llm, prompts, params) -> list[tuple]:
    """Runs the requests together on an engine too small for them (asserting at least one
    preemption), then each alone; asserts equal tokens and returns (together, alone) pairs."""
    from tests.helpers.common import run

    with counting_preemptions(llm) as count:
        together = run(llm, prompts, params)
    assert count["n"] > 0, "the test did not cause any preemption"
    pairs = []
    for i, (p, prm) in enumerate(zip(prompts, params)):
        alone = run(llm, [p], [prm])[0]
        assert list(together[i].outputs[0].token_ids) == list(alone.outputs[0].token_ids), i
        pairs.append((together[i], alone))
    return pairs


# Modules in the order that lets neighbours share the pool's engine (an engine start costs 20 to
# 80 s on the CI box): no engine first, then the users of the compiled Qwen2 engine, the other
# architectures, the hooks engines, the rest, the servers, and the tests that run their own
# engines in subprocesses. Within a module the order is the file's. Unlisted modules run last.
MODULE_ORDER = [
    "unit/",
    "reliability/test_corpus.py", "reliability/test_hostile_neighbours.py", "test_analyzers_engine.py",
    "test_errors.py", "test_lens_args.py", "test_hookllm.py", "test_isolation.py", "test_session.py",
    "test_parity.py", "test_modes.py", "test_parallel.py",
    "test_hooks.py", "test_examples.py", "test_extract.py",
    "test_machinery.py", "reliability/test_limits.py",
    "test_serve.py", "test_serve_client_code.py", "reliability/test_soak.py",
    "test_docs.py", "test_benchmark_smoke.py", "test_vllm_versions.py",
]


def _module_rank(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return next((i for i, m in enumerate(MODULE_ORDER) if path == m or (m.endswith("/") and path.startswith(m))),
                len(MODULE_ORDER))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)          # stable: a module keeps its own order


def pytest_terminal_summary(terminalreporter):
    """The version subset's results (tests/test_vllm_versions.py), one line per vLLM release."""
    import sys

    mod = sys.modules.get("tests.test_vllm_versions")
    for line in getattr(mod, "SUMMARY", ()):
        terminalreporter.write_line(f"[vllm versions] {line}")
