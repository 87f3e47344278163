"""Adapter for vLLM's V2 model runner (`vllm.v1.worker.gpu.model_runner.GPUModelRunner`), the
default on GPU from vLLM 0.26. Layout comes from the `InputBatch` that `prepare_inputs` returns
(its signature differs between 0.26 and 0.32, hence *args). V2 keeps no SamplingParams per
request and re-sends them when a preempted request resumes: the runtime keeps specs itself.
Under FULL CUDA graphs the step is a graph replay with no Python in the model: the routing is
written into persistent buffers here, before the replay.
"""

from __future__ import annotations

import logging

from .base import StepView
from .common import HOOK_STEP, contained, lifecycle, load_model_wrapper, require, run_step, runtime_of
from .patching import wrap_method, when_imported

log = logging.getLogger("vllm_hook")


def _execute_model(orig):
    def execute_model(self, scheduler_output, *args, **kwargs):
        rt = runtime_of(self)
        if rt is None or kwargs.get("dummy_run"):
            return orig(self, scheduler_output, *args, **kwargs)
        lifecycle(rt, scheduler_output)
        out = run_step(rt, scheduler_output, orig, self, scheduler_output, *args, **kwargs)
        contained(rt, "queuing capture copies", rt.end_step)
        return out
    return execute_model


# ---- CUDA graphs for steps with Python hooks --------------------------------------------------
# A FULL graph replay runs no Python. With hook layers, every FULL graph is captured twice more
# (vLLM's BreakableCUDAGraphCapture, attention kept inside): broken at the hook points, where a
# decode step with hooked requests runs its hooks eagerly between the segments; and whole,
# copying the stream at each hook point, for a decode step whose hooks are all read-only: they
# run after its replay on the copies, so it costs one graph launch, not one per segment.
# Steps of other shapes use the piecewise graphs, which the hook points split.
HOOKED = "_vllm_hook_hooked_graphs"
READS = "_vllm_hook_read_graphs"
HOOKS = "_vllm_hook_hooks"
WANT_HOOKED = {"on": False}        # this worker's model has hook points (set at load_model)


def _dispatch(orig):
    """CudaGraphManager.dispatch(num_reqs, num_tokens, uniform_token_count, ...): a step with
    Python hooks may replay a FULL graph only if it has a hooked twin; else it is dispatched
    as not uniform, to a piecewise graph (eager if none). 0.33 also has FULL graphs for
    varlen decode and micro-batches, which have no twin: those steps go piecewise too."""
    from vllm.config.compilation import CUDAGraphMode

    full = CUDAGraphMode.FULL

    def dispatch(self, num_reqs, num_tokens, uniform_token_count=None, *args, **kwargs):
        if not HOOK_STEP["on"]:
            return orig(self, num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
        hooked = self.__dict__.get(HOOKED) or {}
        desc = orig(self, num_reqs, num_tokens, uniform_token_count if hooked else None, *args, **kwargs)
        if desc.cg_mode == full and desc not in hooked:
            if len(args) > 1:                         # (num_active_loras, max_query_len, ...)
                args = (args[0], None, *args[2:])
            if "max_query_len" in kwargs:
                kwargs["max_query_len"] = None
            desc = orig(self, num_reqs, num_tokens, None, *args, **kwargs)
        return desc
    return dispatch


def _capture(orig):
    def capture(self, create_forward_fn, *args, **kwargs):
        out = orig(self, create_forward_fn, *args, **kwargs)
        if WANT_HOOKED["on"] and type(self).__name__ == "ModelCudaGraphManager":
            _capture_hooked(self, create_forward_fn)
        return out
    return capture


def _capture_hooked(manager, create_forward_fn) -> None:
    """The twins of every FULL graph (broken at the hook points; copying the stream there),
    as vLLM captures FULL graphs: warm-up with fresh attention state, then capture in the
    same memory pool."""
    import weakref

    import torch
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.config.compilation import CUDAGraphMode
    from vllm.distributed.parallel_state import graph_capture
    from vllm.model_executor.offloader.base import get_offloader

    from ..model.hook_point import BREAKER

    # Micro-batched FULL graphs (0.33, DBO) capture on their own threads and stream: no twin,
    # and steps with hooks never replay them (`_dispatch`).
    descs = [d for d in manager._capture_descs.get(CUDAGraphMode.FULL, []) if getattr(d, "num_ubatches", 1) == 1]
    if not descs:
        return
    rows = max(d.num_tokens for d in descs)
    targets: list = []

    def sizer(target, boundary, hs, res):
        # In a warm-up (no capture): the copies are allocated outside the graph pool.
        target.make_copy(boundary, hs, rows)
        if not targets:
            targets.append(weakref.ref(target))

    def copier(target, boundary, hs, res):
        target.copy_point(boundary, hs, res)

    def capture(desc, fn):
        create_forward_fn(desc, warmup=True)(CUDAGraphMode.NONE)
        forward_fn = create_forward_fn(desc, warmup=False)
        get_offloader().sync_prev_onload()
        BREAKER["fn"] = fn
        try:
            with _capture_pool(manager) as pool, BreakableCUDAGraphCapture(pool=pool) as cap:
                # Marked FULL, as vLLM's own FULL capture is: attention then stays inside the
                # graph (0.33's attention breaks any breakable capture not marked FULL).
                forward_fn(CUDAGraphMode.FULL)
                get_offloader().join_after_forward()
        finally:
            BREAKER["fn"] = None
        return cap

    hooked, reads = {}, {}
    with torch.inference_mode(), graph_capture(device=manager.device):
        BREAKER["fn"] = sizer
        try:
            create_forward_fn(descs[0], warmup=True)(CUDAGraphMode.NONE)
        finally:
            BREAKER["fn"] = None
        for desc in descs:
            hooked[desc] = capture(desc, _add_eager)
            reads[desc] = capture(desc, copier)
    manager.__dict__[HOOKED], manager.__dict__[READS] = hooked, reads
    manager.__dict__[HOOKS] = targets[0] if targets else None
    log.info("vllm_hook: captured %d FULL CUDA graphs broken at the hook points (%d segments each) "
             "and %d copying the stream there for read-only hooks", len(hooked),
             next(iter(hooked.values())).num_graphs if hooked else 0, len(reads))


def _capture_pool(manager):
    """The graph pool vLLM captures its FULL graphs into (0.33 routes it through
    `capture_pool`, the cuMem pool under sleep mode)."""
    from contextlib import nullcontext

    try:
        from vllm.compilation.cudagraph_pool import capture_pool
    except ImportError:          # 0.26
        return nullcontext(manager.pool)
    return capture_pool(manager.pool, manager.vllm_config)


def _add_eager(target, boundary, hs, res) -> None:
    """Records the hook point as an eager step of the breakable capture in progress: every
    replay runs the step's hooks there, between the graph segments."""
    import weakref

    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.utils.torch_utils import weak_ref_tensor

    # Weak references: the replay writes these addresses, and holding them would pin
    # graph-pool memory across captures (as vLLM's own breakable capture does).
    hs_w, res_w = weak_ref_tensor(hs), (weak_ref_tensor(res) if res is not None else None)
    ref = weakref.ref(target)
    BreakableCUDAGraphCapture.current().add_eager(lambda: _run(ref, boundary, hs_w, res_w))


def _breakable_capture(orig):
    """BreakableCUDAGraphWrapper._capture: vLLM's breakable PIECEWISE graphs
    (VLLM_USE_BREAKABLE_CUDAGRAPH=1; 0.33 turns it on for some architectures) run the model
    without torch.compile, so no splitting op ends a piece there: the hook points break the
    capture as vLLM's attention does, and hooks run eagerly between the segments."""
    from ..model.hook_point import BREAKER

    def _capture(self, *args, **kwargs):
        if not WANT_HOOKED["on"] or BREAKER["fn"] is not None:
            return orig(self, *args, **kwargs)
        BREAKER["fn"] = _add_eager
        try:
            return orig(self, *args, **kwargs)
        finally:
            BREAKER["fn"] = None
    return _capture


def _run(ref, boundary, hs, res) -> None:
    target = ref()
    if target is not None:
        target.run(boundary, hs, res)


def _run_fullgraph(orig):
    def run_fullgraph(self, desc):
        hooked = self.__dict__.get(HOOKED)
        if HOOK_STEP["on"] and hooked and desc in hooked:
            from vllm.model_executor.offloader.base import get_offloader

            get_offloader().sync_prev_onload()
            reads = self.__dict__.get(READS) or {}
            ref = self.__dict__.get(HOOKS)
            target = ref() if ref is not None else None
            if HOOK_STEP["read_only"] and desc in reads and target is not None:
                reads[desc].replay()
                target.run_copies()      # on the copies, queued after the replay
            else:
                hooked[desc].replay()
            return None
        return orig(self, desc)
    return run_fullgraph


def _prepare_inputs(orig):
    def prepare_inputs(self, *args, **kwargs):
        ib = orig(self, *args, **kwargs)
        rt = runtime_of(self)
        if rt is not None and rt.wants_step():
            view = contained(rt, "reading the runner's batch layout", _view, ib)
            if view is not None:
                rt.begin_step(view)
        return ib
    return prepare_inputs


def _view(ib) -> StepView:
    return StepView(index={r: i for i, r in enumerate(ib.req_ids)}, query_start_loc=ib.query_start_loc_np,
                    num_computed=ib.num_computed_tokens_np, num_tokens=int(ib.num_tokens),
                    num_tokens_padded=int(ib.num_tokens_after_padding))


def _patch(mod) -> None:
    cls = mod.GPUModelRunner
    require(cls, ("load_model", "execute_model", "prepare_inputs", "get_model"), "V2 GPUModelRunner")
    wrap_method(cls, "load_model", _load_model)
    wrap_method(cls, "execute_model", _execute_model)
    wrap_method(cls, "prepare_inputs", _prepare_inputs)


def _load_model(orig):
    load = load_model_wrapper(orig)

    def load_model(self, *args, **kwargs):
        out = load(self, *args, **kwargs)
        rt = runtime_of(self)
        WANT_HOOKED["on"] = rt is not None and rt.hooks is not None
        return out
    return load_model


def _patch_graphs(mod) -> None:
    require(mod.CudaGraphManager, ("dispatch", "capture", "run_fullgraph"), "V2 CudaGraphManager")
    wrap_method(mod.CudaGraphManager, "dispatch", _dispatch)
    wrap_method(mod.CudaGraphManager, "capture", _capture)
    wrap_method(mod.CudaGraphManager, "run_fullgraph", _run_fullgraph)


def _patch_breakable(mod) -> None:
    require(mod.BreakableCUDAGraphWrapper, ("_capture",), "BreakableCUDAGraphWrapper")
    wrap_method(mod.BreakableCUDAGraphWrapper, "_capture", _breakable_capture)


def install() -> None:
    when_imported("vllm.v1.worker.gpu.model_runner", _patch)
    when_imported("vllm.v1.worker.gpu.cudagraph_utils", _patch_graphs)
    when_imported("vllm.compilation.breakable_cudagraph", _patch_breakable)
