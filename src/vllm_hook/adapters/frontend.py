"""Frontend patches: engine-config stamping, request admission and offline result delivery.

The frontend counterpart of the runner adapters: it is the only frontend code that touches
vLLM internals (EngineArgs, InputProcessor, LLM's engine loop).
"""

from __future__ import annotations

import logging

from ..config import CONFIG_KEY, HookConfig
from ..model.hook_point import OP_NAME
from .patching import wrap_method, when_imported

PROMPT_INDEX = "_vllm_hook_prompt_index"
EARLY = "_vllm_hook_early"            # on an OutputProcessor while an offline call runs
FIRST = "_vllm_hook_first"            # served: its FetchBatcher (`hold` at first tokens)
log = logging.getLogger("vllm_hook")


def _compiles_one_graph() -> bool:
    """vLLM on the CPU compiles the whole model with Inductor, splitting ops or not."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def external_id(req_id: str) -> str:
    """The id a caller gave a request, from the engine's: vLLM appends "-" and 8 random hex
    characters (`InputProcessor.assign_request_id`)."""
    head, _, tail = req_id.rpartition("-")
    return head if head and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail) else req_id


def input_errors() -> tuple[type[BaseException], ...]:
    """Exceptions with which `LLM.generate` refuses an input (a prompt too long, bad
    parameters, a spec error): ValueError/TypeError, and vLLM's client-error class where the
    release has one (0.32: VLLMClientError, not a ValueError)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError, TypeError)
    return (ValueError, TypeError, VLLMClientError)


def _stamp_config(orig):
    def create_engine_config(self, *args, **kwargs):
        from vllm.config import CompilationMode

        # Validates the user's settings (a clear ValueError at engine construction) and puts
        # them, with the plugin version, into vLLM's compile-cache key.
        cfg = HookConfig.from_additional_config(self.additional_config)
        self.additional_config = {**(self.additional_config or {}), CONFIG_KEY: cfg.stamp()}
        if cfg.hook_layers and not self.enforce_eager and _compiles_one_graph():
            log.warning("vllm_hook: hook_layers is set and this platform compiles the model as "
                        "one graph, which must not contain hook points: running eagerly")
            self.enforce_eager = True
        vllm_config = orig(self, *args, **kwargs)
        cc = vllm_config.compilation_config
        if not cfg.index_asserts:
            # Before the model is built: vLLM copies these options into its compile backend then.
            cc.inductor_compile_config.setdefault("assert_indirect_indexing", False)
        if cfg.hook_layers and cc.mode != CompilationMode.NONE:
            if cc.mode != CompilationMode.VLLM_COMPILE or not cc.splitting_ops:
                raise ValueError(
                    "vllm_hook: hook_layers needs vLLM's piecewise compilation (the default) or "
                    f"enforce_eager=True; this engine compiles with mode {cc.mode.name} and "
                    f"splitting_ops {cc.splitting_ops}, one graph that hook points must not be in")
            if OP_NAME not in cc.splitting_ops:
                # Hook points split the piecewise graphs: hooks run eagerly between the pieces.
                cc.splitting_ops.append(OP_NAME)
        return vllm_config
    return create_engine_config


def _process_inputs(orig):
    from ..frontend.admission import admit, sealed

    def process_inputs(self, request_id, *args, **kwargs):
        # process_inputs(request_id, prompt, params, ...) in every supported version
        params = kwargs["params"] if "params" in kwargs else (args[1] if len(args) > 1 else None)
        with sealed(params):
            request = orig(self, request_id, *args, **kwargs)
        admit(self, request_id, request)
        return request
    return process_inputs


def _render_and_add(orig):
    """Counts the prompts of one call, so a spec error can name the bad one; a spec object
    passed for many prompts is keyed once in the call (`frontend.cache.one_call`)."""
    from ..frontend.cache import one_call

    def render_and_add_requests(self, *args, **kwargs):
        self.__dict__[PROMPT_INDEX] = 0
        try:
            with one_call():
                return orig(self, *args, **kwargs)
        finally:
            self.__dict__.pop(PROMPT_INDEX, None)
    return render_and_add_requests


def _add_one(orig):
    from ..spec.errors import SpecError

    def add_request(self, *args, **kwargs):
        i = self.__dict__.get(PROMPT_INDEX)
        try:
            return orig(self, *args, **kwargs)
        except SpecError as e:
            if i is None:
                raise
            raise e.at_prompt(i) from None
        finally:
            if i is not None:
                self.__dict__[PROMPT_INDEX] = i + 1
    return add_request


def _forget_on_failure(orig):
    """A request vLLM fails to add after admission (past the spec checks) leaves no record."""
    from ..frontend.state import maybe_state

    def add_request(self, request_id, *args, **kwargs):
        try:
            return orig(self, request_id, *args, **kwargs)
        except Exception:
            st = maybe_state(self.input_processor)
            if st is not None:
                st.pop_pending(str(request_id))
            raise
    return add_request


def _run_engine(orig):
    from ..frontend.delivery import attach, drop_early, send_early
    from ..frontend.state import maybe_state

    def run_engine(self, *args, **kwargs):
        eng = self.llm_engine
        st = maybe_state(eng.input_processor)
        send = _sender(eng.engine_core) if st is not None and st.pending else None
        op = eng.output_processor
        if send is not None:
            finished: list[str] = []      # by the engine, in this call's earlier steps

            def early(ids: list[str], last: bool) -> None:
                finished.extend(ids)
                if last:
                    send_early(st, finished, send)
            op.__dict__[EARLY] = early
        try:
            outputs = orig(self, *args, **kwargs)
        except BaseException:
            if st is not None:
                drop_early(st)
            raise
        finally:
            op.__dict__.pop(EARLY, None)
        if st is not None and st.persistent_hooks:
            st.note_finished(str(o.request_id) for o in outputs)
        if st is not None and (st.pending or st.early is not None):
            attach(st, outputs, self.collective_rpc)
        return outputs
    return run_engine


def _sender(engine_core):
    """`send(method, args)`: a collective RPC sent now, its reply waited for later (the
    result getter it returns), where the engine core is a process of its own (vLLM's
    SyncMPClient, whose `call_utility` this splits in two); else None."""
    import uuid
    from concurrent.futures import Future

    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core_client import SyncMPClient

    if type(engine_core) is not SyncMPClient:
        return None

    def send(method: str, args: tuple):
        call_id = uuid.uuid1().int >> 64
        future: Future = Future()
        engine_core.utility_results[call_id] = future
        engine_core._send_input(EngineCoreRequestType.UTILITY,
                                (0, call_id, "collective_rpc", (method, None, args, None)))
        return future.result
    return send


def _process_outputs(orig):
    """While an offline call runs (`_run_engine`): the requests the engine finishes in each
    step are noted, and its last step (every request in flight finishes in it) sends the
    call's fetch before vLLM processes the step's outputs."""

    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        batcher = self.__dict__.get(FIRST)
        if batcher is not None and batcher.first_tokens and engine_core_outputs:
            try:
                _first_tokens(batcher, engine_core_outputs)
            except Exception:       # they are fetched at their finish, as they would have
                log.exception("vllm_hook: fetching requests at their first token failed")
        early = self.__dict__.get(EARLY)
        if early is not None and engine_core_outputs:
            try:
                ids = [o.request_id for o in engine_core_outputs if o.finish_reason is not None]
                if ids:
                    early([external_id(r) for r in ids], len(ids) == len(self.request_states))
            except Exception:       # attach fetches them as it would have
                log.exception("vllm_hook: sending an early fetch failed")
        return orig(self, engine_core_outputs, *args, **kwargs)
    return process_outputs


def _engine_id(request) -> str | None:
    """An admitted EngineCoreRequest's engine id; None until vLLM assigned it (releases with
    `external_req_id` set it with the internal id, after admission, which 0.32 and later may
    run on a thread beside the event loop for raw prompts)."""
    return request.request_id if getattr(request, "external_req_id", "") is not None else None


def _first_tokens(batcher, outputs) -> None:
    """Served: the watched requests (`FirstTokens`) of this step that sampled their first
    token and go on are fetched now (`FetchBatcher.hold`)."""
    watch = batcher.first_tokens.watching(_engine_id)
    go = []
    for o in outputs:
        rid = watch.pop(o.request_id, None)
        if rid is None:
            continue
        if o.finish_reason is None:
            if o.new_token_ids:
                go.append(rid)
            else:              # an output without a token yet: watched on
                watch[o.request_id] = rid
    if go:
        batcher.hold(go)


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
    from .server import BATCHER_ATTR

    async def abort(self, request_id, *args, **kwargs):
        out = await orig(self, request_id, *args, **kwargs)
        st = maybe_state(self.input_processor)
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        keys = forget(st, ids) if st is not None and st.pending else []
        if keys:
            batcher = self.__dict__.get(BATCHER_ATTR)
            if batcher is not None:          # an early fetch's results they will not claim
                batcher.forget(keys)
            await self.collective_rpc(RPC, args=("discard", keys))
        return out
    return abort


def _patch_llm(mod) -> None:
    found = set()
    for klass in mod.LLM.__mro__:
        for name, make in (("_run_engine", _run_engine), ("_render_and_add_requests", _render_and_add),
                           ("_add_request", _add_one)):
            if name in klass.__dict__ and name not in found:
                wrap_method(klass, name, make)
                found.add(name)
    if "_run_engine" not in found:
        raise RuntimeError("vllm-hook: vllm.LLM has no _run_engine; unsupported vLLM version")


def install() -> None:
    when_imported("vllm.engine.arg_utils",
                  lambda m: wrap_method(m.EngineArgs, "create_engine_config", _stamp_config))
    when_imported("vllm.v1.engine.input_processor",
                  lambda m: wrap_method(m.InputProcessor, "process_inputs", _process_inputs))
    when_imported("vllm.entrypoints.llm", _patch_llm)
    when_imported("vllm.v1.engine.llm_engine", _patch_engine)
    when_imported("vllm.v1.engine.async_llm", _patch_async_engine)
    when_imported("vllm.v1.engine.output_processor",
                  lambda m: wrap_method(m.OutputProcessor, "process_outputs", _process_outputs))


def _patch_engine(mod) -> None:
    wrap_method(mod.LLMEngine, "abort_request", _abort_request)
    wrap_method(mod.LLMEngine, "add_request", _forget_on_failure)


def _patch_async_engine(mod) -> None:
    wrap_method(mod.AsyncLLM, "abort", _async_abort)   # add_request: adapters/server.py
