"""Frontend patches: engine-config stamping, request admission and offline result delivery.

The frontend counterpart of the runner adapters: it is the only frontend code that touches
vLLM internals (EngineArgs, InputProcessor, LLM's engine loop).
"""

from __future__ import annotations

from ..config import CONFIG_KEY, HookConfig
from .patching import wrap_method, when_imported


def _stamp_config(orig):
    def create_engine_config(self, *args, **kwargs):
        # Validates the user's settings (a clear ValueError at engine construction) and puts
        # them, with the plugin version, into vLLM's compile-cache key.
        cfg = HookConfig.from_additional_config(self.additional_config)
        self.additional_config = {**(self.additional_config or {}), CONFIG_KEY: cfg.stamp()}
        vllm_config = orig(self, *args, **kwargs)
        if not cfg.index_asserts:
            # Before the model is built: vLLM copies these options into its compile backend then.
            vllm_config.compilation_config.inductor_compile_config.setdefault(
                "assert_indirect_indexing", False)
        return vllm_config
    return create_engine_config


def _process_inputs(orig):
    from ..frontend.admission import admit

    def process_inputs(self, request_id, *args, **kwargs):
        request = orig(self, request_id, *args, **kwargs)
        admit(self, request_id, request)
        return request
    return process_inputs


def _run_engine(orig):
    from ..frontend.delivery import attach
    from ..frontend.state import maybe_state

    def run_engine(self, *args, **kwargs):
        outputs = orig(self, *args, **kwargs)
        st = maybe_state(self.llm_engine.input_processor)
        if st is not None and st.pending:
            attach(st, outputs, self.collective_rpc)
        return outputs
    return run_engine


def _abort_request(orig):
    from ..frontend.delivery import RPC, forget
    from ..frontend.state import maybe_state

    def abort_request(self, request_ids, *args, **kwargs):
        out = orig(self, request_ids, *args, **kwargs)
        st = maybe_state(self.input_processor)
        keys = forget(st, list(request_ids)) if st is not None and st.pending else []
        if keys:
            self.collective_rpc(RPC, args=("discard", keys))
        return out
    return abort_request


def _async_abort(orig):
    from ..frontend.delivery import RPC, forget
    from ..frontend.state import maybe_state

    async def abort(self, request_id, *args, **kwargs):
        out = await orig(self, request_id, *args, **kwargs)
        st = maybe_state(self.input_processor)
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        keys = forget(st, ids) if st is not None and st.pending else []
        if keys:
            await self.collective_rpc(RPC, args=("discard", keys))
        return out
    return abort


def _patch_llm(mod) -> None:
    for klass in mod.LLM.__mro__:
        if "_run_engine" in klass.__dict__:
            wrap_method(klass, "_run_engine", _run_engine)
            return
    raise RuntimeError("vllm-hook: vllm.LLM has no _run_engine; unsupported vLLM version")


def install() -> None:
    when_imported("vllm.engine.arg_utils",
                  lambda m: wrap_method(m.EngineArgs, "create_engine_config", _stamp_config))
    when_imported("vllm.v1.engine.input_processor",
                  lambda m: wrap_method(m.InputProcessor, "process_inputs", _process_inputs))
    when_imported("vllm.entrypoints.llm", _patch_llm)
    when_imported("vllm.v1.engine.llm_engine",
                  lambda m: wrap_method(m.LLMEngine, "abort_request", _abort_request))
    when_imported("vllm.v1.engine.async_llm",
                  lambda m: wrap_method(m.AsyncLLM, "abort", _async_abort))
