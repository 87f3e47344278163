"""Adapter for vLLM's V2 model runner (`vllm.v1.worker.gpu.model_runner.GPUModelRunner`), the
default on GPU from vLLM 0.26. Layout comes from the `InputBatch` that `prepare_inputs` returns
(its signature differs between 0.26 and 0.32, hence *args). V2 keeps no SamplingParams per
request and re-sends them when a preempted request resumes: the runtime keeps specs itself.
Under FULL CUDA graphs the step is a graph replay with no Python in the model: the routing is
written into persistent buffers here, before the replay.
"""

from __future__ import annotations

from .base import StepView
from .common import HOOK_STEP, events, load_model_wrapper, require, run_step, runtime_of
from .patching import wrap_method, when_imported


def _execute_model(orig):
    def execute_model(self, scheduler_output, *args, **kwargs):
        rt = runtime_of(self)
        if rt is None or kwargs.get("dummy_run"):
            return orig(self, scheduler_output, *args, **kwargs)
        rt.on_events(events(scheduler_output, rt.tracks_blocks))
        out = run_step(rt, scheduler_output, orig, self, scheduler_output, *args, **kwargs)
        rt.end_step()
        return out
    return execute_model


def _dispatch(orig):
    """CudaGraphManager.dispatch(num_reqs, num_tokens, uniform_token_count, ...): a step with
    Python hooks is not uniform decode, so it gets a piecewise graph (eager if none)."""
    def dispatch(self, num_reqs, num_tokens, uniform_token_count=None, *args, **kwargs):
        if HOOK_STEP["on"]:
            uniform_token_count = None
        return orig(self, num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
    return dispatch


def _prepare_inputs(orig):
    def prepare_inputs(self, *args, **kwargs):
        ib = orig(self, *args, **kwargs)
        rt = runtime_of(self)
        if rt is not None and rt.wants_step():
            rt.begin_step(StepView(index={r: i for i, r in enumerate(ib.req_ids)},
                                   query_start_loc=ib.query_start_loc_np,
                                   num_computed=ib.num_computed_tokens_np,
                                   num_tokens=int(ib.num_tokens),
                                   num_tokens_padded=int(ib.num_tokens_after_padding)))
        return ib
    return prepare_inputs


def _patch(mod) -> None:
    cls = mod.GPUModelRunner
    require(cls, ("load_model", "execute_model", "prepare_inputs", "get_model"), "V2 GPUModelRunner")
    wrap_method(cls, "load_model", load_model_wrapper)
    wrap_method(cls, "execute_model", _execute_model)
    wrap_method(cls, "prepare_inputs", _prepare_inputs)


def _patch_graphs(mod) -> None:
    require(mod.CudaGraphManager, ("dispatch",), "V2 CudaGraphManager")
    wrap_method(mod.CudaGraphManager, "dispatch", _dispatch)


def install() -> None:
    when_imported("vllm.v1.worker.gpu.model_runner", _patch)
    when_imported("vllm.v1.worker.gpu.cudagraph_utils", _patch_graphs)
