"""Plugin registration: idempotent, lazy, and loud about vLLM versions it does not know."""

from __future__ import annotations

import pytest


def test_register_is_idempotent_and_patches_once():
    from vllm_hook import plugin

    plugin.register()
    plugin.register()
    from vllm.v1.engine.input_processor import InputProcessor

    fn = InputProcessor.process_inputs
    assert getattr(fn, "__vllm_hook__", False)
    assert not getattr(fn.__wrapped__, "__vllm_hook__", False)     # wrapped exactly once


def test_unknown_vllm_version_fails_loudly(monkeypatch):
    import vllm

    from vllm_hook.adapters.common import UnsupportedVllm, check_version

    assert check_version() == vllm.__version__
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(UnsupportedVllm, match="tested on vLLM 0.26, 0.29, 0.30, 0.31, 0.32, 0.33; this is "
                       "vLLM 0.34.0.*allow_untested_vllm=true"):
        check_version()
    assert check_version(allow_untested=True) == "0.34.0"      # at the operator's own risk


def test_missing_runner_attribute_fails_loudly():
    from vllm_hook.adapters.common import UnsupportedVllm, require

    class Runner:
        def load_model(self):
            pass

    with pytest.raises(UnsupportedVllm, match="lacks \\['prepare_inputs'\\]"):
        require(Runner, ("load_model", "prepare_inputs"), "V2 GPUModelRunner")


@pytest.mark.parametrize("asserts", [True, False])
def test_index_asserts_setting_reaches_the_compile_options(asserts):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_hook import plugin
    from vllm_hook.testing.tiny_models import tiny_model

    plugin.register()
    cfg = EngineArgs(model=tiny_model("qwen2"), max_model_len=256, kv_cache_memory_bytes=16 << 20,
                     additional_config={"vllm_hook": {"index_asserts": asserts}}).create_engine_config()
    opts = cfg.compilation_config.inductor_compile_config
    assert opts.get("assert_indirect_indexing", True) is asserts
    assert cfg.additional_config["vllm_hook"]["index_asserts"] is asserts


@pytest.mark.parametrize("raw, words", [
    ({"site": ["q"]}, ["vllm_hook.site: unknown setting", "did you mean 'sites'"]),
    ({"sites": ["qq"]}, ["vllm_hook.sites.0", "'resid_post'", "got 'qq'", "docs/config.md"]),
    ({"max_vectors": 0}, ["vllm_hook.max_vectors", "greater than or equal to 1", "got 0"]),
    ({"hook_layers": "some"}, ["vllm_hook.hook_layers", "a valid list or expected 'all'", "got 'some'"]),
    ([1], ["must be an object of settings"]),
])
def test_engine_config_errors_name_the_key_and_the_fix(raw, words):
    from vllm_hook.config import ConfigError, HookConfig

    with pytest.raises(ConfigError) as e:
        HookConfig.from_additional_config({"vllm_hook": raw})
    assert isinstance(e.value, ValueError) and "pydantic" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_docs_config_table_lists_every_key():
    """docs/config.md's table and HookConfig name the same keys."""
    import re
    from pathlib import Path

    from vllm_hook.config import HookConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    keys = set(HookConfig.model_fields) - {"version"}
    assert documented == keys, f"undocumented: {keys - documented}; not in HookConfig: {documented - keys}"


def test_only_adapters_import_vllm_internals():
    """docs/architecture.md's rule: outside `adapters/`, only vLLM's public names
    (`from vllm import ...`, `import vllm`) are imported."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "src" / "vllm_hook"
    bad = []
    for path in root.rglob("*.py"):
        if "adapters" in path.relative_to(root).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*(from vllm\.|import vllm\.)", line):
                bad.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not bad, "vLLM internals imported outside adapters/:\n" + "\n".join(bad)


def test_only_adapters_read_vllm_internal_attributes():
    """The same rule for attributes: the engine, its input processor, the HF config and the
    request's cache salt are read only in `adapters/` (requests.py, model.py, ...)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "src" / "vllm_hook"
    pat = re.compile(r"\.(llm_engine|engine_core|hf_config|hf_text_config|cache_salt|vllm_config)\b")
    bad = []
    for path in root.rglob("*.py"):
        if "adapters" in path.relative_to(root).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pat.search(code):
                bad.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not bad, "vLLM internals read outside adapters/:\n" + "\n".join(bad)


def test_v2_dispatch_never_replays_a_full_graph_without_a_hooked_twin():
    """vLLM 0.33 has FULL graphs no hooked twin mirrors (varlen decode, micro-batches): a step
    with Python hooks is dispatched again as not uniform, with no query-length bound."""
    from collections import namedtuple
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    from vllm_hook.adapters.common import HOOK_STEP
    from vllm_hook.adapters.v2 import HOOKED, _dispatch

    Desc = namedtuple("Desc", "cg_mode key")
    calls = []

    def orig(self, num_reqs, num_tokens, uniform, num_active_loras=0, max_query_len=None, num_ubatches=1):
        calls.append((uniform, max_query_len))
        full = uniform is not None or max_query_len is not None
        return Desc(CUDAGraphMode.FULL if full else CUDAGraphMode.PIECEWISE, (uniform, max_query_len))

    dispatch = _dispatch(orig)
    twin = orig(None, 8, 8, 1)
    calls.clear()
    mgr = SimpleNamespace()
    try:
        HOOK_STEP["on"] = True
        assert dispatch(mgr, 8, 8, 1, 0, max_query_len=1).cg_mode == CUDAGraphMode.PIECEWISE   # no twins
        assert calls == [(None, 1), (None, None)]
        mgr.__dict__[HOOKED] = {twin: object()}
        calls.clear()
        assert dispatch(mgr, 8, 8, 1, 0).cg_mode == CUDAGraphMode.FULL         # the twinned graph
        assert calls == [(1, None)]
        HOOK_STEP["on"] = False
        calls.clear()
        dispatch(mgr, 8, 8, 1, 0, 4)                                           # unhooked: untouched
        assert calls == [(1, 4)]
    finally:
        HOOK_STEP["on"] = False
