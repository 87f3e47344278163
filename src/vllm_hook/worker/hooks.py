"""Python hooks on the worker: per-request instances, the per-step plan, running them at
each hook point (`model/hook_point.py`), persistent hooks and their results.

A hook that raises, returns a wrong shape, or grows its state past `max_hook_state_bytes`
fails for its own request only (an error in its results; it runs no more for that request);
the rows it was given stay as they were. Returned rows are written back with non-finite
values replaced and every value clamped to `steer_bound`, so no hook can make the stream,
and so the KV cache others reuse, hold inf or NaN.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable

import numpy as np
import torch

from ..delivery.hostmem import upload
from ..hooks import registry
from ..hooks.context import BatchHookContext, HookContext
from ..hooks.hook import Hook, unpickle_hook
from ..hooks.state import CtxList, StateError, nbytes, to_host
from ..model.hook_point import new_owner
from .hook_graphs import HookGraphs

log = logging.getLogger("vllm_hook")
HOOK_CACHE = 256              # distinct hooks kept built (by digest): a batch shares one object
STATE_CHECK_EVERY = 64        # calls between checks of a request's hook state size


@dataclass(eq=False)
class HookInstance:
    index: int                                   # in the request's spec, or among persistent hooks
    hook: Hook
    ctx: HookContext
    points: tuple[tuple[int, int, bool], ...]    # (boundary, layer, pre)
    label: str
    errors: list[str]                            # the request's error list
    failed: bool = False
    calls: int = 0
    # Failures so far, of all instances: a step's groups look for failed members only when
    # it moved (a scan of every member per call cost 64 checks per layer at 64 requests).
    failures: ClassVar[int] = 0

    def stop(self) -> None:
        """Run no more (the request failed elsewhere; its error is recorded there)."""
        self.failed = True
        HookInstance.failures += 1

    def fail(self, msg: str) -> None:
        if not self.failed:
            self.stop()
            self.errors.append(f"{self.label}: {msg}; it runs no more for this request")
            log.warning("vllm_hook: request %s: %s: %s", self.ctx.request_id, self.label, msg)


@dataclass(eq=False)
class RequestHooks:
    spec: list[HookInstance] = field(default_factory=list)
    persistent: list[HookInstance] = field(default_factory=list)
    read_only: bool = False          # every hook is: its decode steps may run them after the forward

    @property
    def all(self) -> list[HookInstance]:
        return self.persistent + self.spec


class WorkerHooks:
    def __init__(self, access: Any, num_layers: int, boundaries: set[int], cfg: Any,
                 bound: float, tp_rank: int = 0, tp_size: int = 1, local: set[int] | None = None):
        self.access, self.num_layers, self.boundaries = access, num_layers, set(boundaries)
        # The hook points this worker's layers hold (pipeline parallelism: its stage's); a
        # hook's points elsewhere are other stages' to run.
        self.local = self.boundaries if local is None else self.boundaries & set(local)
        self.cfg, self.bound, self.tp_rank, self.tp_size = cfg, bound, tp_rank, tp_size
        self.owner = new_owner(self)
        # Per hook point: the stream copied there by the FULL graphs' read-only twins
        # (`adapters/v2.py`), which the hooks of a read-only step read after the replay.
        self.copies: dict[int, torch.Tensor] = {}
        self._built: OrderedDict[str, Hook] = OrderedDict()
        self.persistent: list[Hook] = []
        self.persistent_results: OrderedDict[str, list] = OrderedDict()
        self.persistent_dropped = 0
        self._plan: dict[int, list] | None = None
        self._last: tuple | None = None     # (entries, plan, each entry's instances) of the last step
        # Per batched group (hook, points): its requests and CallLogs while they stay the same.
        self._epochs: dict[tuple, tuple] = {}
        self.timing = dict.fromkeys(("hook_calls", "hook_s", "hook_steps", "read_only_steps", "plans_reused"), 0.0)
        # Steady read-only steps replayed from a CUDA graph of the hooks' kernels; `capturing`
        # while one is captured (errors then abort the capture, not the hooks).
        self.graphs = HookGraphs(self.timing) if getattr(cfg, "hook_graphs", False) else None
        self.capturing = False
        registry.load(tuple(cfg.hook_modules))

    # ---- building ------------------------------------------------------------------------
    def build(self, entry: dict) -> Hook:
        """The Hook of a wire entry ({"pickle": bytes} or {"name", "args"}), built once per
        digest: requests sending the same hook share one object (and a batched call)."""
        key = entry.get("digest") or ""
        hook = self._built.get(key)
        if hook is None:
            if "pickle" in entry:
                hook = unpickle_hook(entry["pickle"])
            else:
                hook = registry.build(entry["name"], entry.get("args") or {})[0]
            self._built[key] = hook
            while len(self._built) > HOOK_CACHE:
                self._built.popitem(last=False)
        else:
            self._built.move_to_end(key)
        return hook

    def _points(self, hook: Hook) -> tuple[tuple[int, int, bool], ...]:
        pts = []
        for layer in hook.layer_indices:
            L = layer % self.num_layers
            b = L if hook.pre else L + 1
            if b not in self.boundaries:
                raise ValueError(f"layer {L} has no hook point in this engine (hook_layers)")
            if b in self.local:
                pts.append((b, L, hook.pre))
        return tuple(pts)

    def _instance(self, index: int, hook: Hook, req_id: str, prompt_len: int, errors: list[str],
                  persistent: bool) -> HookInstance:
        kind = "persistent hook" if persistent else "hook"
        label = f"{kind} {index}" + (f" ({hook.name})" if hook.name else "")
        ctx = HookContext(req_id, prompt_len, self.access, self.tp_rank, self.tp_size)
        return HookInstance(index, hook, ctx, self._points(hook), label, errors)

    def for_request(self, req_id: str, prompt_len: int, wire_hooks: Iterable[dict],
                    errors: list[str]) -> RequestHooks | None:
        rh = RequestHooks()
        for i, h in enumerate(self.persistent):
            rh.persistent.append(self._instance(i, h, req_id, prompt_len, errors, True))
        for entry in wire_hooks:
            i = int(entry["i"])
            try:
                rh.spec.append(self._instance(i, self.build(entry), req_id, prompt_len, errors, False))
            except Exception as e:
                errors.append(f"hook {i} could not be built on the worker: {e!r}")
                log.exception("vllm_hook: request %s: building hook %d failed", req_id, i)
        rh.read_only = all(i.hook.read_only for i in rh.all)
        return rh if rh.spec or rh.persistent else None

    # ---- per step ----------------------------------------------------------------------------
    def plan(self, entries: Iterable[tuple[RequestHooks, int, int, int]]) -> None:
        """This step's calls per hook point, from (hooks, first row, rows, first position)
        of each hooked request in the batch. A batched hook's requests form one group per
        step, shared by all its layers (their rows, offsets and contexts are built once).
        A step with the same requests at the same rows as the last (steady decode) reuses
        the last plan: only positions move."""
        entries = [e for e in entries if e[2] > 0]
        last = self._last
        if last is not None and len(last[0]) == len(entries) and all(
                a[0] is b[0] and a[1] == b[1] and a[2] == b[2] for a, b in zip(last[0], entries)):
            self._reuse([e[3] for e in entries])
            self._last = (entries, last[1], last[2])
            return
        plan: dict[int, list] = {}
        groups: dict[tuple, _Group] = {}
        for rh, start, count, first in entries:
            for inst in rh.all:
                if inst.failed or not inst.points:       # no points: its layers are other stages'
                    continue
                self._tick(inst)
                if inst.hook.batched:
                    key = (id(inst.hook), inst.points)
                    g = groups.get(key)
                    if g is None:
                        g = groups[key] = _Group(self._epochs, key)
                        for b, L, pre in inst.points:
                            plan.setdefault(b, []).append((pre, g, L))
                    g.add(inst, start, count, first)
                else:
                    inst.ctx._at(inst.points[0][1], inst.hook.pre, first, count)
                    for b, L, pre in inst.points:
                        plan.setdefault(b, []).append((pre, inst, L, start, count))
        # Call logs of groups not in this step end: a group that comes back starts new ones.
        for key in [k for k in self._epochs if k not in groups]:
            del self._epochs[key]
        for calls in plan.values():
            calls.sort(key=lambda c: c[0])          # post (False) first; stable otherwise
        self._plan = plan or None
        self._last = (entries, self._plan, [tuple(e[0].all) for e in entries])
        self.timing["hook_steps"] += bool(plan)

    def advance(self) -> bool:
        """A step that repeats the last one's rows (`worker/repeat.py`: the same requests at
        the same rows, each one position on): the last plan again, without building entries.
        False where there is no plan to reuse (then `plan`)."""
        if self._last is None:
            return False
        self._reuse(None)
        return True

    def _reuse(self, firsts: list[int] | None) -> None:
        """The last plan for this step: each request's first position from `firsts` (by
        entry), or one further than the last step's."""
        plan, per_entry = self._last[1], self._last[2]
        for i, insts in enumerate(per_entry):
            for inst in insts:
                if not inst.failed:
                    self._tick(inst)
                    inst.ctx._first_pos = firsts[i] if firsts is not None else inst.ctx._first_pos + 1
        self._plan = plan
        self.timing["hook_steps"] += plan is not None
        self.timing["plans_reused"] += 1

    def clear_plan(self) -> None:
        """After a step: no hook runs until the next plan (the last one is kept for reuse)."""
        self._plan = None

    def forget(self) -> None:
        """The next step plans from scratch (planning failed, or the engine stopped routing)."""
        self._plan = self._last = None
        self._drop_graph()

    def _drop_graph(self) -> None:
        if self.graphs is not None:
            self.graphs.reset()

    @property
    def planned(self) -> bool:
        return self._plan is not None

    def run(self, boundary: int, hs: torch.Tensor, res: torch.Tensor | None) -> None:
        """At hook point `boundary` of this step: post hooks of the layer before, then pre
        hooks of the layer after; persistent hooks first, then each request's in spec order.
        Batched hooks: one call for all requests that share the hook object."""
        plan = self._plan
        if plan is None:
            return
        calls = plan.get(boundary)
        if not calls:
            return
        t0 = time.perf_counter()
        try:
            if hs.is_cuda and not self.capturing and torch.cuda.is_current_stream_capturing():
                return           # vLLM's graph captures record no hook
            _Point(self, hs, res).run(calls)
        except Exception:          # a bug of ours: never the engine's step
            if self.capturing:
                raise
            log.exception("vllm_hook: running hooks at boundary %d failed", boundary)
            _fail_calls(calls, "internal error in vllm_hook while running hooks")
        self.timing["hook_s"] += time.perf_counter() - t0

    # ---- read-only steps under FULL graphs (adapters/v2.py) ----------------------------------
    def make_copy(self, boundary: int, hs: torch.Tensor, rows: int) -> None:
        """Allocate hook point `boundary`'s copy ([rows, hidden]; before any capture)."""
        if boundary not in self.copies:
            self.copies[boundary] = torch.empty((rows, hs.shape[-1]), dtype=hs.dtype, device=hs.device)

    def copy_point(self, boundary: int, hs: torch.Tensor, res: torch.Tensor | None) -> None:
        """Copy the stream at `boundary` (recorded into a graph: no Python at replay)."""
        out = self.copies[boundary][:hs.shape[0]]
        if res is None:
            out.copy_(hs)
        else:
            torch.add(hs, res, out=out)

    def run_copies(self) -> None:
        """After a read-only twin's replay: this step's hooks on the copies, in layer order."""
        if self._plan is None:
            return
        self.timing["read_only_steps"] += 1
        if self.graphs is None or not self.graphs.step(self):
            self._run_all()

    def _run_all(self) -> None:
        for b in sorted(self._plan):
            hs = self.copies.get(b)
            if hs is None:          # a bug of ours (a point the twins do not copy): not the step's
                log.error("vllm_hook: no copy of hook point %d for a read-only step", b)
                _fail_calls(self._plan[b], "internal error in vllm_hook: this hook point was not copied")
                continue
            self.run(b, hs, None)

    def call(self, fn: Callable, ctx, h: torch.Tensor, insts: list[HookInstance], L: int):
        self.timing["hook_calls"] += 1
        try:
            return fn(ctx, h)
        except Exception as e:
            if self.capturing:      # the capture fails; the step runs eagerly, where it counts
                raise
            for inst in insts:
                inst.fail(f"raised {type(e).__name__}: {e} (layer {L})")
            return None

    def _tick(self, inst: HookInstance) -> None:
        """One more step of the request: its state's size is checked every STATE_CHECK_EVERY."""
        inst.calls += 1
        if not inst.calls % STATE_CHECK_EVERY:
            self._check_state(inst)

    def _check_state(self, inst: HookInstance) -> None:
        """The size of the request's hook state against max_hook_state_bytes."""
        try:
            size = nbytes(inst.ctx.saved)
        except StateError as e:
            size, err = 0, str(e)
        else:
            err = None
        limit = self.cfg.max_hook_state_bytes
        if err or size > limit:
            inst.ctx.saved.clear()
            inst.fail(err or f"ctx.saved holds {size} bytes, more than max_hook_state_bytes="
                      f"{limit}; save less per step (e.g. a reduction, or the last rows only) or "
                      "raise additional_config vllm_hook.max_hook_state_bytes")

    # ---- results -------------------------------------------------------------------------
    def finish(self, req_id: str, rh: RequestHooks) -> tuple[list, Any]:
        """The request's spec-hook results (saved dicts, by spec index) queued to host memory,
        with the event to wait for; persistent hook results go to their store."""
        for inst in rh.all:
            self._check_state(inst)                  # the last check, whatever the count
        # Its groups' call logs end (they hold its context, and so its device tensors), and
        # a plan that holds it is not reused.
        if self._last is not None and any(e[0] is rh for e in self._last[0]):
            self._last = None
            self._drop_graph()
        mine = {id(inst.ctx) for inst in rh.all}
        for key in [k for k, (members, _) in self._epochs.items() if any(id(c) in mine for c in members)]:
            del self._epochs[key]
        spec = [inst.ctx.saved for inst in sorted(rh.spec, key=lambda i: i.index)]
        if rh.persistent and self.tp_rank == 0:
            trees, event = to_host([i.ctx.saved for i in rh.persistent])
            self.persistent_results[req_id] = (trees, event)
            while len(self.persistent_results) > self.cfg.max_persistent_hook_results:
                self.persistent_results.popitem(last=False)
                self.persistent_dropped += 1
        if not spec or self.tp_rank != 0:
            return [], None
        return to_host(spec)

    def collect(self) -> dict[str, list]:
        out = {}
        for rid, (trees, event) in self.persistent_results.items():
            if event is not None:
                event.synchronize()
            out[rid] = trees
        return out

    def register(self, hooks: list[Hook]) -> int:
        for h in hooks:
            self._points(h)          # refuse layers without a hook point before keeping any
        self.persistent.extend(hooks)
        return len(self.persistent)

    def clear(self) -> None:
        self.persistent.clear()

    def clear_results(self) -> int:
        n = len(self.persistent_results)
        self.persistent_results.clear()
        return n


class _Point:
    """One hook point of one step. Per-request hooks read their rows from one copy of the
    stream (one kernel for all of them, not one each) and their results are written back
    together (one sanitising pass and one write for all), so a per-request hook costs little
    more than its own work; a request's next hook at the same point sees the write first."""

    def __init__(self, hooks: WorkerHooks, hs: torch.Tensor, res: torch.Tensor | None):
        self.hooks, self.hs, self.res = hooks, hs, res
        self._stream: torch.Tensor | None = None
        self._pending: list[tuple[int, int, torch.Tensor]] = []     # start, count, rows
        self._pending_reqs: set[int] = set()
        self._end = 0

    def run(self, calls: list) -> None:
        self._end = max(c[1].end if isinstance(c[1], _Group) else c[3] + c[4] for c in calls)
        for c in calls:
            if isinstance(c[1], _Group):
                self._flush()
                self._batch(c[1], c[2], c[0])
            else:
                self._one(c)
        self._flush()

    def _rows(self, rows) -> torch.Tensor:
        hs, res = self.hs, self.res
        return hs[rows] + res[rows] if res is not None else hs[rows].clone()

    def _one(self, call) -> None:
        pre, inst, L, start, count = call
        if inst.failed:
            return
        first = inst.ctx._first_pos
        if id(inst.errors) in self._pending_reqs:      # this request's earlier hook wrote
            self._flush()
        if self._stream is None:
            self._stream = self._rows(slice(0, self._end))
        h = self._stream[start:start + count]
        out = self.hooks.call(inst.hook.fn, inst.ctx._at(L, pre, first, count), h, [inst], L)
        if out is not None and self._check(out, h, [inst], L, inst.hook):
            self._pending.append((start, count, out))
            self._pending_reqs.add(id(inst.errors))

    def _batch(self, g: "_Group", L: int, pre: bool) -> None:
        if not g.live():
            return
        rows = g.rows if g.rows is not None else g.index(self)
        h = self._rows(rows)
        ctx = BatchHookContext(g.ctxs, g.offsets, L, pre, self.hooks.access,
                               self.hooks.tp_rank, self.hooks.tp_size, self.hooks.num_layers)
        for c in g.ctxs:
            c.layer_idx = L
        out = self.hooks.call(g.insts[0].hook.fn, ctx, h, g.insts, L)
        if out is not None and self._check(out, h, g.insts, L, g.insts[0].hook):
            self._write(rows, out)

    def _index(self, segs: list[tuple[int, int]]):
        """The rows of `segs`: a slice when they follow one another, else an index tensor."""
        if all(a[0] + a[1] == b[0] for a, b in zip(segs, segs[1:])):
            return slice(segs[0][0], segs[-1][0] + segs[-1][1])
        idx = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in segs])
        return upload(torch.from_numpy(idx), self.hs.device)

    @staticmethod
    def _check(out, h, insts: list[HookInstance], L: int, hook: Hook) -> bool:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        if hook.read_only:
            msg = f"returned {got} at layer {L}, but it is read_only: it must return None"
        elif isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(h.shape):
            return True
        else:
            msg = f"returned {got}, expected a tensor of shape {tuple(h.shape)} or None (layer {L})"
        for inst in insts:
            inst.fail(msg)
        return False

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = sorted(self._pending, key=lambda p: p[0]), []
        self._pending_reqs.clear()
        rows = self._index([(s, n) for s, n, _ in pending])
        out = pending[0][2] if len(pending) == 1 else torch.cat([o.to(self.hs.device) for _, _, o in pending])
        self._write(rows, out)
        self._stream = None          # stale now: the next reader copies the stream again

    def _write(self, rows, out: torch.Tensor) -> None:
        hs, res, b = self.hs, self.res, self.hooks.bound
        # The stream must stay finite whatever a hook returns (module docstring).
        safe = torch.nan_to_num(out.to(device=hs.device, dtype=torch.float32), nan=0.0,
                                posinf=b, neginf=-b).clamp_(-b, b)
        if res is None:
            hs[rows] = safe.to(hs.dtype)
        else:
            # The next layer adds hs + res: zero one, the other carries the whole stream.
            hs[rows] = 0
            res[rows] = safe.to(res.dtype)


class _Group:
    """The requests of one batched hook in this step, in row order: their contexts, rows
    and offsets in `h`, built once and shared by every layer the hook runs at."""

    __slots__ = ("insts", "ctxs", "segs", "offsets", "end", "rows", "seen")

    def __init__(self, epochs: dict | None = None, key=None):
        self.seen = HookInstance.failures
        self.insts: list[HookInstance] = []
        self.ctxs: CtxList = CtxList((), epochs, key)
        self.segs: list[tuple[int, int]] = []
        self.offsets: list[tuple[int, int]] = []
        self.end, self.rows = 0, None

    def add(self, inst: HookInstance, start: int, count: int, first: int) -> None:
        inst.ctx._at(inst.points[0][1], inst.hook.pre, first, count)
        self.insts.append(inst)
        self.ctxs.append(inst.ctx)
        self.offsets.append((self.offsets[-1][0] + self.offsets[-1][1] if self.offsets else 0, count))
        self.segs.append((start, count))
        self.end = max(self.end, start + count)

    def _set(self, pairs) -> None:
        """The group as ((start, count), instance) pairs, in row order."""
        self.insts = [i for _, i in pairs]
        self.ctxs = CtxList([i.ctx for i in self.insts], self.ctxs.epochs, self.ctxs.key)
        self.segs = [seg for seg, _ in pairs]
        self.offsets, at = [], 0
        for _, n in self.segs:
            self.offsets.append((at, n))
            at += n
        self.rows = None

    def live(self) -> bool:
        """Drop requests whose hook failed at an earlier layer; whether any remain."""
        if self.seen != HookInstance.failures:
            self.seen = HookInstance.failures
            if any(i.failed for i in self.insts):
                self._set([(seg, i) for seg, i in zip(self.segs, self.insts) if not i.failed])
        return bool(self.insts)

    def index(self, point: "_Point"):
        if any(a[0] > b[0] for a, b in zip(self.segs, self.segs[1:])):   # rows in row order, as the hook sees them
            self._set(sorted(zip(self.segs, self.insts), key=lambda x: x[0][0]))
        self.rows = point._index(self.segs)
        return self.rows


def _fail_calls(calls: list, msg: str) -> None:
    """Fail every hook instance of a hook point's planned calls."""
    for c in calls:
        for inst in (c[1].insts if isinstance(c[1], _Group) else [c[1]]):
            inst.fail(msg)
