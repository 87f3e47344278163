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
    monkeypatch.setattr(vllm, "__version__", "0.29.1")
    with pytest.raises(UnsupportedVllm, match="supports vLLM 0.26, 0.32, 0.33; this is vLLM 0.29.1"):
        check_version()


def test_missing_runner_attribute_fails_loudly():
    from vllm_hook.adapters.common import UnsupportedVllm, require

    class Runner:
        def load_model(self):
            pass

    with pytest.raises(UnsupportedVllm, match="lacks \\['prepare_inputs'\\]"):
        require(Runner, ("load_model", "prepare_inputs"), "V2 GPUModelRunner")
