"""Steady read-only hook steps replayed from a CUDA graph of their own.

A decode step whose hooks are all read-only runs them after the forward's replay, on copies
of the stream (`adapters/v2.py`). In steady decode those calls launch the same kernels on the
same buffers step after step, and their launches were the cost: a logit lens at 4 layers is
about ten launches per step, four of them Triton's at about 25 µs of host time each, and at
16 requests the host, not the device, set the step's pace (docs/benchmarks.md, run 54).

When every call of a reused plan belongs to a batched hook marked `graphable`, the plan's
calls are captured into one CUDA graph once the plan has been reused `CAPTURE_AFTER` times,
and every later step of that plan replays it: one launch. The hooks' `ctx.save` calls are
recorded at capture (`hooks/state.RECORDING`) and made again after each replay on copies of
the graph's outputs, which the next replay overwrites. One graph at a time: a new plan drops
it. A capture that fails (a hook that synchronises, say) leaves that plan eager.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..hooks import state

log = logging.getLogger("vllm_hook")
CAPTURE_AFTER = 4           # reuses of a plan before its calls are captured (capture: ~1 ms)
WHOLE_STORAGE = 4           # an output clones its whole storage unless it is this much larger


class HookGraphs:
    """The CUDA graph of the current steady plan's read-only calls (`WorkerHooks.run_copies`)."""

    def __init__(self, timing: dict):
        self.plan: Any = None               # the plan counted or captured (held: ids stay unique)
        self.reuses = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.saves: list[tuple] = []        # (append fn, key, output, requests, segments)
        self.bases: list[torch.Tensor] = []  # the outputs' storages, cloned after each replay
        self.views: list[tuple] = []        # per save: (base index, size, stride, offset) or None
        self.failures = 0                   # HookInstance.failures when captured
        self.refused: Any = None            # a plan whose capture failed: eager for its life
        self.stream: torch.cuda.Stream | None = None
        self.warm = False                   # the side stream has run the calls once (cuBLAS state)
        self.timing = timing                # the worker's hook counters (stats())
        for k in ("graph_captures", "graph_replays", "graph_refusals"):
            timing.setdefault(k, 0.0)

    def drop(self) -> None:
        self.graph, self.saves, self.bases, self.views = None, [], [], []

    def reset(self) -> None:
        """The plan ended (a request of it finished): nothing of it is held."""
        self.drop()
        self.plan = self.refused = None
        self.reuses = 0

    def step(self, hooks: Any) -> bool:
        """Run this read-only step's calls from the graph if it can; False: run them eagerly."""
        plan = hooks._plan
        if plan is not self.plan:
            self.drop()
            self.plan, self.reuses = plan, 0
            return False
        from .hooks import HookInstance

        if self.graph is not None:
            if self.failures != HookInstance.failures:      # a member failed: its group changed
                self.drop()
                self.refused = plan
                return False
            self.graph.replay()
            self._save(hooks)
            return True
        self.reuses += 1
        if self.reuses < CAPTURE_AFTER or self.refused is plan or not _graphable(plan, hooks):
            return False
        if not self.warm:                   # this step eagerly on the side stream, capture next
            self.warm = True
            self.reuses -= 1
            return self._on_side(hooks._run_all)
        return self._capture(hooks, plan)

    def _on_side(self, fn) -> bool:
        cur = torch.cuda.current_stream()
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            fn()
        cur.wait_stream(self.stream)
        return True

    def _capture(self, hooks: Any, plan: Any) -> bool:
        from .hooks import HookInstance

        g, rec = _new_graph(), []
        ok = False
        state.RECORDING, hooks.capturing = rec, True
        try:
            def calls():
                g.capture_begin(capture_error_mode="thread_local")
                try:
                    hooks._run_all()
                finally:
                    g.capture_end()
            self._on_side(calls)
            ok = True
        except Exception as e:
            log.warning("vllm_hook: the read-only hooks of a steady batch could not be captured "
                        "into a CUDA graph (%r); they run eagerly for this batch", e)
        finally:
            state.RECORDING, hooks.capturing = None, False
        if not ok:
            self.refused = plan
            self.timing["graph_refusals"] += 1
            return False
        self.graph, self.saves, self.failures = g, rec, HookInstance.failures
        self._plan_copies()
        self.timing["graph_captures"] += 1
        g.replay()                          # the capture ran nothing: this step's work
        self._save(hooks)
        return True

    def _plan_copies(self) -> None:
        """How each recorded output is copied after a replay: its storage cloned once (the
        lens's eight saves are slices of two tensors), or itself where the storage is much
        larger (a slice of a graph intermediate)."""
        seen: dict[int, int] = {}
        self.bases, self.views = [], []
        for _, _, t, _, _ in self.saves:
            st = t.untyped_storage()
            span = t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) if t.numel() else 0
            if st.nbytes() > WHOLE_STORAGE * span + 4096:
                self.views.append(None)
                continue
            i = seen.get(st.data_ptr())
            if i is None:
                i = seen[st.data_ptr()] = len(self.bases)
                self.bases.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(st))
            self.views.append((i, tuple(t.shape), tuple(t.stride()), t.storage_offset()))

    def _save(self, hooks: Any) -> None:
        """The recorded saves again, on copies of this replay's outputs."""
        self.timing["graph_replays"] += 1
        copies = [b.clone() for b in self.bases]
        try:
            for (fn, key, t, who, segs), v in zip(self.saves, self.views):
                if v is None:
                    out = t.clone()
                else:
                    i, size, stride, offset = v
                    out = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                        copies[i].untyped_storage(), offset, size, stride)
                fn(key, out, who, segs)
        except Exception as e:             # as an eager save that raised: the hooks fail
            for c in hooks._plan.values() if hooks._plan else ():
                for call in c:
                    for inst in call[1].insts:
                        inst.fail(f"ctx.save failed: {e!r}")
            self.drop()
            self.refused = self.plan


def _graphable(plan: dict, hooks: Any) -> bool:
    """Every call a batched, read-only, graphable hook's over one run of rows (an index
    tensor would be uploaded from host memory the graph does not own), on a GPU."""
    from .hooks import _Group

    for b, calls in plan.items():
        cp = hooks.copies.get(b)
        if cp is None or not _on_gpu(cp):
            return False
        for c in calls:
            g = c[1]
            if not isinstance(g, _Group) or not g.insts or not isinstance(g.rows, slice):
                return False
            h = g.insts[0].hook
            if not (h.graphable and h.read_only and h.batched):
                return False
    return True


def _new_graph():
    return torch.cuda.CUDAGraph()


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda
