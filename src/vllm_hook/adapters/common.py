"""What both runner adapters share: version gate, runtime set-up, scheduler events, RPC."""

from __future__ import annotations

import logging
from typing import Any

from ..config import HookConfig
from ..hooks import kernels
from ..model.instrument import instrument
from ..spec.resolve import steer_bound
from ..spec.schema import SPEC_KEY
from ..worker.hooks import WorkerHooks
from ..worker.runtime import HookRuntime
from .base import NewRequest, SchedulerEvents, wire_of
from .requests import model_info

log = logging.getLogger("vllm_hook")

# vLLM releases whose runner internals this adapter layer is tested against (docs/versions.md):
# 0.26 and 0.33 on the GPU (V2 runner), 0.29 to 0.32 on the CPU (V1 runner).
SUPPORTED_VLLM = ("0.26", "0.29", "0.30", "0.31", "0.32", "0.33")
RT_ATTR = "_vllm_hook_rt"


class UnsupportedVllm(RuntimeError):
    pass


def check_version(allow_untested: bool = False) -> str:
    import vllm

    v = getattr(vllm, "__version__", "unknown")
    if ".".join(v.split(".")[:2]) not in SUPPORTED_VLLM:
        msg = (f"vllm-hook is tested on vLLM {', '.join(SUPPORTED_VLLM)}; this is vLLM {v}. Its model "
               "runner may differ, so captures, steering or hooks could fail or be wrong.")
        if not allow_untested:
            raise UnsupportedVllm(
                msg + " Install a tested vLLM; or set additional_config "
                "vllm_hook.allow_untested_vllm=true to start anyway, at your own risk; or set "
                "VLLM_HOOK_DISABLE=1 to run without the plugin.")
        log.warning("vllm_hook: %s Starting anyway (allow_untested_vllm).", msg)
    return v


def require(obj: Any, attrs: tuple[str, ...], what: str) -> None:
    missing = [a for a in attrs if not hasattr(obj, a)]
    if missing:
        raise UnsupportedVllm(f"vllm-hook: {what} lacks {missing}; this vLLM build is not one the "
                              "adapter knows. Set VLLM_HOOK_DISABLE=1 to run without the plugin.")


def runtime_of(runner: Any) -> HookRuntime | None:
    return runner.__dict__.get(RT_ATTR)


def setup_runtime(runner: Any, model: Any, vllm_config: Any) -> HookRuntime:
    """Instrument the freshly loaded model and attach a runtime to the runner (idempotent)."""
    rt = runtime_of(runner)
    if rt is not None:
        return rt
    cfg = HookConfig.from_vllm_config(vllm_config)
    version = check_version(cfg.allow_untested_vllm)
    pp = vllm_config.parallel_config.pipeline_parallel_size
    info = model_info(vllm_config.model_config)
    sc = vllm_config.scheduler_config
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    from .model import find_layers, local_layers
    from .attention import layer_infos
    from .params import ModelAccess

    rank = get_tensor_model_parallel_rank()
    pp_rank = get_pp_group().rank_in_group if pp > 1 else 0
    tp = vllm_config.parallel_config.tensor_parallel_size
    hooks = None
    mine = local_layers(find_layers(model))
    if cfg.hook_layers:
        # A hook point sits after a layer (0: before the first): this stage's layers' points.
        local = {i + 1 for i in mine} | ({0} if 0 in mine else set())
        hooks = WorkerHooks(ModelAccess(model, rank, tp), info.num_layers, cfg.hook_boundaries(info.num_layers),
                            cfg, steer_bound(info, cfg.max_ops_per_layer), rank, tp, local)
        param = next(model.parameters())
        kernels.warm(param.device, vllm_config.model_config.dtype, info.hidden_size,
                     vllm_config.model_config.get_vocab_size())
    bufs, points, attns = instrument(model, info, cfg, max_num_batched_tokens=sc.max_num_batched_tokens,
                                     max_num_seqs=sc.max_num_seqs, dtype=vllm_config.model_config.dtype,
                                     hook_owner=hooks.owner if hooks else 0)
    rt = HookRuntime(bufs, points, cfg, rank=rank, attn_layers=layer_infos(attns, runner, rank, info),
                     hooks=hooks, pp_rank=pp_rank, local_layers=mine)
    runner.__dict__[RT_ATTR] = rt
    log.info("vllm_hook: instrumented %d layers (sites %s) for vLLM %s, %s runner; device buffers "
             "%.1f MiB", info.num_layers, ",".join(cfg.sites), version, type(runner).__module__,
             bufs.nbytes() / 2**20)
    return rt


def load_model_wrapper(orig):
    """Runner.load_model, then instrument the model: before vLLM compiles or captures it."""
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        setup_runtime(self, self.get_model(), self.vllm_config)
        return out
    return load_model


NO_EVENTS = SchedulerEvents()
# Set while the runner runs a step in which Python hooks run ("on"; "read_only": all of them
# are): the CUDA-graph dispatch must then pick a FULL graph's hooked twin, piecewise graphs or
# eager, never a plain FULL replay, which runs no Python.
HOOK_STEP = {"on": False, "read_only": False}


def contained(rt: HookRuntime, what: str, fn, *args) -> Any:
    """A piece of the plugin's work on the engine's step path (reading the runner's internals
    included): if it raises, the plugin turns itself off on this worker, with the reason in
    the log and in every affected request's results, and the engine step goes on unhooked."""
    try:
        return fn(*args)
    except Exception as e:
        if not rt.off:
            log.exception("vllm_hook: %s failed", what)
        rt.disable(f"{what} failed: {e!r}")
        return None


def lifecycle(rt: HookRuntime, scheduler_output: Any) -> None:
    """The step's admissions and finishes (also while the plugin is off: its requests then
    get the reason in their results)."""
    contained(rt, "reading the scheduler output",
              lambda: rt.on_events(events(scheduler_output, rt.tracks_blocks)))


def run_step(rt: HookRuntime, scheduler_output: Any, orig, *args, **kwargs):
    """The runner's execute_model, with the step's hook flag set while it dispatches."""
    kind = contained(rt, "reading the scheduled requests",
                     lambda: rt.hooks_in(scheduler_output.num_scheduled_tokens)) or 0
    HOOK_STEP["on"], HOOK_STEP["read_only"] = kind > 0, kind == 1
    try:
        return orig(*args, **kwargs)
    finally:
        HOOK_STEP["on"] = HOOK_STEP["read_only"] = False


def events(scheduler_output: Any, track_blocks: bool = False) -> SchedulerEvents:
    """The step's lifecycle events; block ids of running requests only when `track_blocks`
    (some request reads its KV cache), so requests without a spec cost O(1) per step."""
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if (not scheduler_output.scheduled_new_reqs and not scheduler_output.finished_req_ids
            and not track_blocks and not getattr(cached, "resumed_req_ids", None)):
        return NO_EVENTS        # most decode steps: nothing to build
    new = tuple(
        NewRequest(r.req_id, wire_of(r.sampling_params, SPEC_KEY), len(r.prompt_token_ids or ()))
        for r in scheduler_output.scheduled_new_reqs
    )
    resumed = frozenset(getattr(cached, "resumed_req_ids", None) or ())
    blocks = {r.req_id: (tuple(r.block_ids), True) for r in scheduler_output.scheduled_new_reqs}
    if cached is not None and track_blocks:
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids is not None:
                blocks[rid] = (tuple(ids), rid in resumed)
    return SchedulerEvents(new=new, finished=frozenset(scheduler_output.finished_req_ids or ()),
                           resumed=resumed, blocks=blocks)


def worker_rpc(worker: Any, op: str, *args: Any) -> Any:
    """Entry point of `collective_rpc("vllm_hook_call", args=(op, ...))` on every worker."""
    rt = runtime_of(worker.model_runner)
    if rt is None:
        return {"error": "vllm_hook is not active on this worker (VLLM_HOOK_DISABLE set there?)"}
    if op == "fetch":
        return rt.fetch(*args)
    if op == "discard":
        return rt.discard(*args)
    if op == "register_vectors":
        return rt.register_vectors(*args)
    if op == "delete_vectors":
        return rt.delete_vectors(*args)
    if op == "stats":
        return rt.stats()
    if op in ("register_hooks", "collect_hooks", "clear_hook_results", "clear_hooks", "prefetch_params"):
        from .frontend import external_id

        return rt.persistent_hooks(op, *args, ids=external_id)
    raise ValueError(f"unknown vllm_hook rpc {op!r}")
