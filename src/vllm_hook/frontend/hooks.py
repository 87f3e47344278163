"""Persistent hooks from the frontend: what to send the workers, and what their replies mean.
One core for `vllm_hook.register_hooks(llm, ...)` offline and the `/v1/hook/hooks/*` routes."""

from __future__ import annotations

from typing import Any, Sequence

from ..hooks import state
from ..spec.errors import SpecError
from ..spec.hooks import resolve_hooks
from ..spec.schema import NamedHook, PickledHook
from .delivery import checked
from .state import FrontendState, allow_pickles


def register_args(st: FrontendState, hooks: Sequence[Any]) -> tuple:
    """The RPC arguments registering `hooks` (Hook objects, {"name", "args"} or {"pickle"})
    on every worker; SpecError names a bad one."""
    if not hooks:
        raise SpecError("hooks", "no hooks given", "pass at least one hook")
    items = [h if not isinstance(h, dict) else (NamedHook(**h) if "name" in h else PickledHook(**h))
             for h in hooks]
    n = st.info.num_layers
    entries = resolve_hooks(items, n, st.cfg.layers_of(st.cfg.hook_layers, n), allow_pickles(st),
                            tuple(st.cfg.hook_modules))
    return ("register_hooks", entries)


def registered(st: FrontendState, replies: Sequence[Any]) -> int:
    count = int(checked(replies)[0])
    st.persistent_hooks = count
    return count


def collect_args(st: FrontendState) -> tuple:
    """Collect, after making final the hooks of the requests finished here since last time."""
    return ("collect_hooks", st.take_finished())


def collected(replies: Sequence[Any]) -> dict[str, list[dict]]:
    """{request id: [saved dict of each persistent hook]} from the workers' replies: TP rank 0
    of each pipeline stage replies (in stage order), the others reply empty."""
    got = _with_blobs(replies)
    stages = [state.decode_collected(r["blob"]) for r in got]
    if len(stages) <= 1:
        return stages[0] if stages else {}
    ids = list(dict.fromkeys(rid for s in stages for rid in s))
    numbers = [r.get("pp_rank", i) for i, r in enumerate(got)]
    return {rid: state.merge_stages([s.get(rid, []) for s in stages], numbers) for rid in ids}


def collected_blob(replies: Sequence[Any]) -> bytes:
    """The collect replies as one safetensors blob (served): a stage's own, or, with several
    pipeline stages, their merged results encoded again."""
    got = _with_blobs(replies)
    if len(got) <= 1:
        return got[0]["blob"] if got else b""
    return state.encode_collected(collected(replies))


def _with_blobs(replies: Sequence[Any]) -> list[dict]:
    return [r for r in checked(replies) if r and r.get("blob")]


def prefetched(replies: Sequence[Any]) -> list[str]:
    """The parameter names cached on the workers (each pipeline stage gathers its own)."""
    return sorted({n for r in checked(replies) for n in r})


def cleared(st: FrontendState) -> None:
    st.persistent_hooks = 0
