"""Offline API on a `vllm.LLM`: named vectors and engine statistics."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .adapters.requests import input_processor_of
from .frontend import hooks as _hooks
from .frontend import vectors as _vectors
from .frontend.delivery import RPC, checked
from .frontend.state import state_of


def _state(llm: Any):
    return state_of(input_processor_of(llm))


def register_vectors(llm: Any, vectors: Mapping[str, Any]) -> list[str]:
    """Store named steering vectors on the engine; specs may then name them. Returns all names."""
    return _vectors.register(_state(llm), vectors, llm.collective_rpc)


def delete_vectors(llm: Any, names: list[str]) -> list[str]:
    return _vectors.delete(_state(llm), names, llm.collective_rpc)


def stats(llm: Any) -> dict:
    """Worker-side counters of rank 0 (admitted requests, retained bytes, table use, seconds
    spent in fetches, ...), and under "frontend" this process's delivery timing (seconds in
    the fetch RPC, reading results, building `Results`, summed; fetches, and steering-only
    requests delivered without one, counted; and the process's seconds in Python's collector,
    `gc_s`, as under rank 0's "timing" for its own)."""
    out = dict(checked(llm.collective_rpc(RPC, args=("stats",)))[0])
    out["frontend"] = _state(llm).counters()
    return out


def register_hooks(llm: Any, hooks: Sequence[Any]) -> int:
    """Run `hooks` (vllm_hook.Hook, or {"name", "args"} operator hooks) for every request
    from now on, until `clear_hooks`. Returns how many persistent hooks are registered."""
    st = _state(llm)
    return _hooks.registered(st, llm.collective_rpc(RPC, args=_hooks.register_args(st, hooks)))


def collect_hook_results(llm: Any) -> dict[str, list[dict]]:
    """{request id: [ctx.saved of each persistent hook]} of the finished requests since the
    last `clear_hook_results` (non-destructive)."""
    return _hooks.collected(llm.collective_rpc(RPC, args=_hooks.collect_args(_state(llm))))


def clear_hook_results(llm: Any) -> int:
    """Drop the collected persistent-hook results; returns how many requests had some."""
    return int(checked(llm.collective_rpc(RPC, args=("clear_hook_results",)))[0])


def clear_hooks(llm: Any) -> None:
    """Stop running the persistent hooks (for requests admitted from now on)."""
    checked(llm.collective_rpc(RPC, args=("clear_hooks",)))
    _hooks.cleared(_state(llm))


def prefetch_params(llm: Any, names: Sequence[str]) -> list[str]:
    """Gather model parameters for `ctx.get_parameter` ahead of time on every worker (over
    tensor-parallel ranks; needed before hooks run when parameters live on other stages)."""
    return _hooks.prefetched(llm.collective_rpc(RPC, args=("prefetch_params", list(names))))


__all__ = ["register_vectors", "delete_vectors", "stats", "register_hooks", "collect_hook_results",
           "clear_hook_results", "clear_hooks", "prefetch_params"]
