"""The per-worker runtime: admits requests, writes each step's routing, collects captures.

It sees vLLM only through `adapters.base` views. Every entry point is guarded: a failure in
the plugin fails the affected requests (their results carry the error), never the engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..adapters.base import AttnLayer, SchedulerEvents, StepView
from ..config import HookConfig
from ..delivery.collector import Collector
from ..delivery.hostmem import one_thread, upload
from ..delivery.spill import sweep_spilled
from ..delivery.nogc import no_gc
from ..delivery.store import Budget, NotLent, RequestStore, batch_to_wire
from ..gc_clock import process_clock
from ..hooks.state import StateError, encode, encode_collected
from ..model.buffers import HookBuffers, cap_points, pack_op
from ..model.layout import POOL_Q, POOL_RESID, TRASH_ROWS, PointTable
from ..spec.resolve import unpack_steer
from ..routing import (CaptureRoute, RequestRoutes, Rows, Segment, SteerGroups, SteerRoute, StepRouting,
                       group_captures, broadcast_sources, route_step)
from .attention_jobs import AttnJob, scores_for_step
from .repeat import StepRepeat
from .hooks import RequestHooks, WorkerHooks
from .prepared import Prepared, PreparedReplies
from .tables import DeviceTables, TableFull
from .steer_shapes import ShapeCache, SteerShape, shape_of
from .wire import check_coefficients, check_source, check_wire

log = logging.getLogger("vllm_hook")
HOOK_TENSOR_PREFIX = "hk"
MAX_SHARED_CAPTURES = 256     # distinct capture specs whose routes a worker keeps
BROADCAST_FROM = 128          # rows steered alike from which a device copy beats writing them
BROADCAST_LOOP_MAX = 2        # runs copied one by one; more: one gather for all of them


class Errors(list):
    """A request's errors. The first withdraws its clean mark (`delivery.arena`, clean marks):
    its frontend then fetches the errors instead of assuming there are none."""

    __slots__ = ("unmark",)

    def __init__(self):
        super().__init__()
        self.unmark = None

    def append(self, msg) -> None:
        super().append(msg)
        if self.unmark is not None:
            self.unmark()

    def extend(self, msgs) -> None:
        super().extend(msgs)
        if self and self.unmark is not None:
            self.unmark()


@dataclass(eq=False)
class HookRequest:
    req_id: str
    key: str
    prompt_len: int
    routes: RequestRoutes
    horizon: float
    op_rows: list[int] = field(default_factory=list)
    vec_rows: list[tuple[int, int]] = field(default_factory=list)    # (vector row, references)
    store: RequestStore = field(default_factory=RequestStore)
    errors: list[str] = field(default_factory=Errors)
    finished_at: float | None = None
    fetched: bool = False
    attn_jobs: dict[int, list[AttnJob]] = field(default_factory=dict)   # q point -> jobs
    attn_heads: dict[int, list[int]] = field(default_factory=dict)      # out point -> heads
    blocks: dict[int, list[int]] = field(default_factory=dict)          # kv group -> block ids
    hooks: RequestHooks | None = None
    hook_results: tuple[list, Any] | None = None                        # (saved trees, event)
    steer_share: str | None = None          # its steering rows are those of this shared entry
    capture_dropped: bool = False           # its rows passed the worker's in-flight budget
    widen: bool = False                     # its rows go to the host in float32 (wire "W")


@dataclass(eq=False)
class SharedSteering:
    """Table rows and routes of one distinct steering (by the spec's steer digest), shared by
    every request that steers the same way: admitted once, released with the last of them."""
    routes: tuple
    vec_rows: list[tuple[int, int]]
    op_rows: list[int]
    refs: int = 1
    groups: tuple | None = None          # routing.group_steering(routes), made once


def _widens(req: HookRequest) -> bool:
    return req.widen


def _note(errors: list[str], msg: str) -> None:
    """Record an error once: a failure that repeats every step is one message."""
    if msg not in errors:
        errors.append(msg)


def broadcast_rows(op_idx: torch.Tensor, broadcast: list[tuple[int, int]]) -> None:
    """Copy each listed run's first row over its other rows (`routing.route_step`'s
    `broadcast`), on `op_idx`'s device, queued after the upload of the step's rows on the same
    stream. A few runs (a batch steering alike: one) are copied one by one; more (prompts each
    steered its own way) by one gather and one scatter, not a copy launched per request (the
    runs are disjoint, as `routing._write_whole` makes them: no run's rows are another's source)."""
    if len(broadcast) <= BROADCAST_LOOP_MAX:
        for start, count in broadcast:
            if count > 1:
                op_idx[start + 1:start + count].copy_(op_idx[start:start + 1].expand(count - 1, -1))
        return
    src, dst = broadcast_sources(broadcast)
    if len(src):
        idx = upload(torch.from_numpy(np.stack([src, dst])), op_idx.device)
        op_idx.index_copy_(0, idx[1], op_idx.index_select(0, idx[0]))


class _Staging:
    """Host-side routing arrays. On a GPU: two pinned sets, used in turn, each guarded by the
    event of its last copy (the CPU prepares step N+1 while the GPU runs step N)."""

    def __init__(self, bufs: HookBuffers):
        self.bufs = bufs
        self.on_device = bufs.device.type != "cpu"
        # Prompt chunks steered alike at every token, from this many rows: their first row is
        # written here and copied over the rest on the device (`broadcast_rows`). On
        # the CPU the arrays are the buffers themselves: written whole.
        self.broadcast_from = BROADCAST_FROM if self.on_device else None
        self.wait_s = 0.0          # waiting for a set's last copy (a device behind the host)
        if self.on_device:
            self._sets = [(torch.zeros_like(bufs.op_idx, device="cpu").pin_memory(),
                           torch.zeros_like(bufs.cap_idx, device="cpu").pin_memory(), None)
                          for _ in range(2)]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]    # one per set, re-recorded
        self._turn = 0
        # Per set, the capture entries its last step wrote (None: not known, the set is filled
        # with trash whole). Resetting only those, not every row and point (1.3 ms a
        # 16,384-row prefill step on the CI machine), keeps the rest trash.
        self._written: list[list | None] = [None, None]

    def begin(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.on_device:
            return self.bufs.op_idx.numpy(), self.bufs.cap_idx.numpy()
        op, cap, event = self._sets[self._turn]
        if event is not None and not event.query():
            t = time.perf_counter()
            event.synchronize()
            self.wait_s += time.perf_counter() - t
        return op.numpy(), cap.numpy()

    def clear_captures(self, cap: np.ndarray, trash: np.ndarray, whole: bool = False) -> None:
        """Make every entry of `cap` (this turn's [rows, points] view) its row's trash row."""
        written = self._written[self._turn]
        if written is None or whole:
            cap[:] = trash[:cap.shape[0], None]
        else:
            for rows, cols in written:      # rows: an index array, or a slice (a prompt's range)
                cap[rows, cols] = trash[rows, None] if isinstance(rows, slice) else trash[rows]
        self._written[self._turn] = []

    def wrote(self, entries: list) -> None:
        """The capture entries this turn's step wrote (`StepRouting.cap_written`)."""
        self._written[self._turn] = list(entries)

    def commit(self, op_rows: int, cap_rows: int, broadcast: list[tuple[int, int]] = ()) -> None:
        if not self.on_device:
            return
        op, cap, _ = self._sets[self._turn]
        if op_rows:
            self.bufs.op_idx[:op_rows].copy_(op[:op_rows], non_blocking=True)
            broadcast_rows(self.bufs.op_idx, broadcast)
        if cap_rows:
            self.bufs.cap_idx[:cap_rows].copy_(cap[:cap_rows], non_blocking=True)
        event = self._events[self._turn]
        event.record()
        self._sets[self._turn] = (op, cap, event)
        self._turn ^= 1


class HookRuntime:
    def __init__(self, bufs: HookBuffers, points: PointTable, cfg: HookConfig, rank: int = 0,
                 attn_layers: list[AttnLayer | None] | None = None, hooks: WorkerHooks | None = None,
                 pp_rank: int = 0, local_layers: set[int] | None = None):
        self.bufs, self.points, self.cfg = bufs, points, cfg
        # The residual stream is identical on every TP rank: rank 0 captures it. Attention
        # heads are sharded: every rank captures its own.
        self.rank = rank
        # Pipeline parallelism: this worker's stage and the decoder layers it runs; requests'
        # captures of other layers are the other stages'.
        self.pp_rank = pp_rank
        self.local_layers = set(range(points.num_layers)) if local_layers is None else set(local_layers)
        self.attn_layers = attn_layers or []
        self.tables = DeviceTables(bufs)
        self.staging = _Staging(bufs)
        self.budget = Budget(cfg.capture_limits()[1])     # unfetched captures, all requests
        self.collector = Collector(bufs.pools, self._deliver, arena_bytes=cfg.arena_bytes(),
                                   widens=_widens, room=self._budget_room)
        self.requests: dict[str, HookRequest] = {}     # admitted, not yet finished
        self.active: dict[str, HookRequest] = {}       # may still be routed
        self.done: dict[str, HookRequest] = {}         # finished, results waiting for a fetch
        self.named: dict[str, np.ndarray] = {}
        self.hooks = hooks                             # Python hooks (None: no hook layers)
        self.shared_steering: dict[str, SharedSteering] = {}
        self._steer_shapes = ShapeCache()              # steering alike at other strengths
        self._captures: dict[str, tuple] = {}          # capture digest -> _capture_routes
        self.hooked: dict[str, HookRequest] = {}       # admitted requests with hooks
        self._steer_dirty = 0
        self._attn_reqs = 0
        self._step: StepRouting | None = None
        self._repeated: tuple[StepRouting, int] | None = None    # (routing, k): see worker.repeat
        self.repeat = StepRepeat()
        self._trash = (bufs.shape.pool_rows + np.arange(bufs.shape.max_tokens) % TRASH_ROWS)
        self.steps_routed = 0
        self.off: str | None = None          # why the plugin turned itself off (disable)
        # Seconds spent in fetches (draining copies, writing results), summed.
        # The plugin's host time on the step path: step_host_s routes and queues copies (over
        # hooked_steps: what a hooked step adds to vLLM's host work), repeated_s the part of it in
        # steps that repeated the last routing (over repeated_steps: steady decode); events_s
        # admits and finishes requests (once per request, not per step).
        # prepare_s: fetch replies made while the device runs the step ending their requests
        # (`_prepare`), within step_host_s.
        self.timing = dict.fromkeys(("fetches", "fetch_s", "write_s", "hooked_steps", "step_host_s",
                                     "events_s", "repeated_steps", "repeated_s", "drain_s", "captures_dropped",
                                     "prepare_s"), 0.0)
        self.prepared = PreparedReplies(self.collector.arena)
        self._finishing: list[HookRequest] = []   # routed to their horizon in the step in flight
        self._lent_to: tuple[str, ...] = ()       # the arenas the last fetch's frontend mapped
        process_clock()          # this process's seconds in Python's collector, from now on
        if cfg.result_spill_dir:
            sweep_spilled(cfg.result_spill_dir, max_age_s=cfg.result_ttl_s)

    # ---- lifecycle -------------------------------------------------------------------------
    def on_events(self, ev: SchedulerEvents) -> None:
        if ev.empty:
            return
        with one_thread():                 # small host tensors: see hostmem.one_thread
            self._on_events(ev)

    def _on_events(self, ev: SchedulerEvents) -> None:
        t0 = time.perf_counter()
        self.repeat.forget()
        self.collector.close_run()
        # Each request's bookkeeping is guarded on its own: a failure costs only that request.
        for rid in ev.finished:
            self._guarded(rid, self._finish, rid)
        for nr in ev.new:
            if nr.req_id in self.requests:
                self._guarded(nr.req_id, self._reactivate, nr.req_id)
            elif nr.wire is not None:
                self._guarded(nr.req_id, self._admit, nr.req_id, nr.wire)
            elif self.hooks is not None and self.hooks.persistent:
                self._guarded(nr.req_id, self._admit_plain, nr.req_id, nr.prompt_len)
        for rid in ev.resumed:
            if rid in self.requests:
                self._guarded(rid, self._reactivate, rid)
        for rid, (groups, replace) in ev.blocks.items():
            req = self.requests.get(rid)
            if req is not None and req.attn_jobs:
                self._guarded(rid, self._track_blocks, req, groups, replace)
        self._guarded(None, self._expire)
        self.timing["events_s"] += time.perf_counter() - t0

    def disable(self, reason: str) -> None:
        """Turn the plugin's work off on this worker after a failure on the step path (an
        internal of vLLM that changed, say): every admitted request gets the reason in its
        results and runs unhooked from now on, as does every later one; nothing steers or
        hooks any more. Lifecycle bookkeeping and fetches go on, so the errors reach the
        requests."""
        if self.off:
            return
        self.off = reason
        log.error("vllm_hook: turned off on this worker: %s. Requests run unhooked from now on, "
                  "with this error in their results.", reason)
        msg = self._off_message()
        for req in list(self.requests.values()) + list(self.done.values()):
            _note(req.errors, msg)
        for rid in list(self.requests):        # preempted ones too: none may resume routing
            self._fail(rid, msg)
        self.active.clear()
        for req in list(self.hooked.values()):
            self._finish_hooks(req)
        if self.hooks is not None:
            self.hooks.forget()
        self.repeat.forget()
        self._step = self._repeated = None
        self._steer_dirty = 0
        self.bufs.op_idx.zero_()             # no stale steering in any later step
        self.prepared.drop()                 # their fetches get the off message

    def _off_message(self) -> str:
        return f"vllm_hook turned itself off on this worker ({self.off}): nothing was captured, steered or hooked"

    def _guarded(self, req_id: str | None, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # never take the engine down, nor another request
            log.exception("vllm_hook: bookkeeping of request %s failed", req_id)
            self._fail(req_id, f"internal error in vllm_hook bookkeeping: {e!r}")

    def _fail(self, req_id: str | None, msg: str) -> None:
        """Record `msg` on the request and stop routing it (its rows run unhooked)."""
        req = self.requests.get(req_id) if req_id is not None else None
        if req is None:
            return
        _note(req.errors, msg)
        self.active.pop(req_id, None)
        self._release_tables(req)
        req.routes = RequestRoutes(req.prompt_len)
        if req.hooks is not None:
            for inst in req.hooks.all:
                inst.stop()

    @staticmethod
    def _track_blocks(req: HookRequest, groups, replace: bool) -> None:
        for g, ids in enumerate(groups):
            if replace or g not in req.blocks:
                req.blocks[g] = list(ids)
            else:
                req.blocks[g].extend(ids)

    def _admit(self, req_id: str, wire: dict) -> None:
        P = int(wire["P"])
        req = HookRequest(req_id=req_id, key=str(wire["key"]), prompt_len=P,
                          routes=RequestRoutes(P), horizon=-1, store=RequestStore(self.budget),
                          widen=wire.get("W") == 1)
        self.requests[req_id] = req
        if self.off:
            req.errors.append(self._off_message())
            return
        sd = wire.get("sd")
        shared = isinstance(sd, str) and sd in self.shared_steering
        shape = None
        if not shared and wire.get("steer"):       # its ops are read only when not shared
            # Steering alike at other strengths: only its coefficients are read (and checked)
            ops = self._steer_shapes.columns(wire.get("ss"), wire["steer"])
            shape = self._steer_shapes.get(wire.get("ss"), ops) if ops is not None else None
            wire = {**wire, "steer": ops if shape is not None else unpack_steer(wire["steer"])}
        cd = wire.get("cd")
        if not wire.get("cap"):
            cd = ""                      # no captures (steering only): one entry for all
        known = self._captures.get(cd) if isinstance(cd, str) else None
        coef = check_wire(wire, self.bufs.shape.num_layers, self.bufs.shape.hidden, self.points,
                          steer_ops=not shared and shape is None, caps=known is None)
        if shape is not None:
            try:
                coef = check_coefficients(wire["steer"]["c"], shape.n)
            except (KeyError, TypeError) as e:
                raise ValueError(f"steering ops are malformed ({e!r})") from None
        try:
            steer = self._steering_of(req, wire.get("steer", ()), sd, coef, shape, wire.get("ss"))
        except (TableFull, KeyError) as e:
            msg = str(e) if isinstance(e, TableFull) else f"vector {e} is not registered on the worker"
            req.errors.append(f"steering not applied: {msg}")
            log.error("vllm_hook: request %s: %s", req_id, req.errors[-1])
            steer = ()
        if known is None:
            known = self._capture_routes(wire.get("cap", ()))
            if isinstance(cd, str):
                if len(self._captures) >= MAX_SHARED_CAPTURES:
                    self._captures.clear()
                self._captures[cd] = known
        capture, cap_groups, attn_jobs = known
        if attn_jobs:
            req.attn_jobs = {q: list(jobs) for q, jobs in attn_jobs.items()}
            self._attn_reqs += 1
        share = self.shared_steering.get(req.steer_share) if req.steer_share else None
        req.routes = RequestRoutes(P, steer, capture, share.groups if share else None, cap_groups)
        req.horizon = req.routes.horizon
        if "M" in wire:             # no position past the last forwarded one (`frontend.admission`)
            req.horizon = min(req.horizon, P + int(wire["M"]) - 2)
        if self.hooks is not None and (wire.get("hooks") or self.hooks.persistent):
            self._add_hooks(req, wire.get("hooks", ()))
        if req.routes.steer or req.routes.capture or req.hooks:
            self.active[req_id] = req
        self._mark_clean(req, wire.get("t"))

    def _mark_clean(self, req: HookRequest, ticket) -> None:
        """A steering-only request admitted without an error: marked so in the arena, its
        frontend delivers it without a fetch unless an error withdraws the mark."""
        arena = self.collector.arena
        if (arena is None or not isinstance(ticket, int) or ticket <= 0 or req.errors
                or req.routes.capture or req.attn_jobs or req.hooks is not None):
            return
        arena.mark_clean(ticket)
        req.errors.unmark = lambda: arena.unmark(ticket)

    def _capture_routes(self, caps) -> tuple:
        """A wire's captures on this worker: (routes, their groups, attention jobs by q point),
        the same for every request capturing alike (kept by the wire's capture digest)."""
        points: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
        attn: dict[int, tuple[set, list]] = {}            # layer -> (heads, selectors)
        for c in caps:
            site, L, sel = c["site"], int(c["layer"]), (c["sel"], tuple(c["pos"]))
            if site == "attn_scores":
                if L not in self.local_layers:
                    continue
                heads, sels = attn.setdefault(L, (set(), []))
                heads.update(c["heads"])
                sels.append(sel)
                points.setdefault(self.points.col("q", L), []).append(sel)
                continue
            point = self.points.col(site, L)
            if self.points.writer[point] not in self.local_layers:
                continue               # another pipeline stage captures it
            if self.rank == 0 or self.points.pool_of(point) != POOL_RESID:
                points.setdefault(point, []).append(sel)
        capture = tuple(CaptureRoute(p, tuple(dict.fromkeys(s)), all(x[0] == "last" for x in s),
                                     self.points.pool_of(p)) for p, s in points.items())
        jobs = {}
        for L, (heads, sels) in attn.items():
            q_point = self.points.col("q", L)
            jobs[q_point] = (AttnJob(L, q_point, self.points.col("attn_scores", L),
                                     tuple(sorted(heads)), tuple(dict.fromkeys(sels))),)
        return capture, group_captures(capture), jobs

    def _admit_plain(self, req_id: str, prompt_len: int) -> None:
        """A request without a spec, while persistent hooks are registered."""
        if self.off:
            return
        req = HookRequest(req_id=req_id, key="", prompt_len=prompt_len,
                          routes=RequestRoutes(prompt_len), horizon=-1, store=RequestStore(self.budget))
        self.requests[req_id] = req
        self._add_hooks(req, ())
        if req.hooks:
            self.active[req_id] = req

    def _add_hooks(self, req: HookRequest, wire_hooks) -> None:
        req.hooks = self.hooks.for_request(req.req_id, req.prompt_len, wire_hooks, req.errors)
        if req.hooks is not None:
            self.hooked[req.req_id] = req
            req.horizon = float("inf")          # hooks see every row, to the end

    def _steering_of(self, req: HookRequest, ops, digest: str | None, coef: np.ndarray | None,
                     shape: SteerShape | None = None, shape_key: str | None = None) -> tuple[SteerRoute, ...]:
        """The request's steering routes: those of a request steering the same way, if one
        is admitted (a batch with one spec admits its 28 ops once; `ops` unread), else
        admitted now with coefficients `coef` (checked: `check_wire`); `shape`: kept for a
        request that steered alike at other strengths."""
        shared = self.shared_steering.get(digest) if digest else None
        if shared is None:
            if not ops:
                return ()
            if shape is None:
                shape = shape_of(ops, self.bufs.shape)
                self._steer_shapes.put(shape_key, shape)
            routes, groups = self._admit_steering(req, shape, coef, ops)
            if not digest:
                return routes
            shared = self.shared_steering[digest] = SharedSteering(routes, req.vec_rows, req.op_rows, 0, groups)
            req.vec_rows, req.op_rows = [], []
        shared.refs += 1
        req.steer_share = digest
        return shared.routes

    def _admit_steering(self, req: HookRequest, shape: SteerShape, coef: np.ndarray,
                        ops: dict[str, list]) -> tuple[tuple[SteerRoute, ...], SteerGroups]:
        """A spec's steering of `shape` with coefficients `coef` (ops, 5) into the tables: a
        vector row per distinct vector (from the wire's columns `ops` where it is new), an op
        row each with its parameters. Its routes and their groups (`routing.group_steering`)."""
        tables, K, n = self.tables, self.bufs.shape.ops_per_layer, shape.n
        rows = []
        try:
            for d, refs, i in zip(shape.distinct, shape.refs, shape.firsts):
                # new to the tables: its values, as this wire gives them
                new = tables.row_of(d) is None
                row = tables.acquire_vector(d, self._vector(ops, i) if new else None, refs)
                rows.append(row)
                req.vec_rows.append((row, refs))
            params = np.zeros((n, 4 + K))
            params[:, :5] = coef
            if len(rows) == 1:           # one vector (most specs): scalars, no gathers
                vec_rows = rows[0]
                params[:, 0] *= tables.norms[rows[0]]
            else:
                vec_rows = np.asarray(rows, dtype=np.int64)[shape.vidx]
                params[:, 0] *= np.asarray([tables.norms[row] for row in rows])[shape.vidx]
            if shape.earlier:            # ops sharing rows with ops of lower slots
                params[:, 5:] = shape.products(K, tables.units.__getitem__, rows)
            req.op_rows = tables.acquire_ops(params)
        except Exception:
            self._release_tables(req)
            raise
        entries = pack_op(np.asarray(req.op_rows, dtype=np.int64), vec_rows)
        # Plain tuples in SteerRoute's field order, made by zip in C (a SteerRoute each costs
        # 2.5 µs more a spec): steering is written from the groups, the routes are read by position
        routes = tuple(zip(shape.cols, entries.tolist(), shape.sels, shape.poss))
        groups = SteerGroups([(sel, pos, cols, entries[idx], sl) for sel, pos, cols, idx, sl in shape.groups
                              ]).knowing(shape.reach)
        return routes, groups

    def _vector(self, ops: dict[str, list], i: int) -> np.ndarray:
        """The values of op `i`'s vector in a wire's columns: carried (float32 bytes, checked
        here: a wire whose shape the worker knows has no other check of them) or named."""
        if "vec" not in ops and "blob" in ops:       # read for a kept shape: `ShapeCache.columns`
            ops.update(unpack_steer(ops["blob"]))
        try:
            vec, name = ops["vec"][i], ops["name"][i]
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"steering ops are malformed ({e!r})") from None
        check_source(i, name, vec, self.bufs.shape.hidden)
        return self.named[name] if vec is None else np.frombuffer(vec, dtype=np.float32)

    def _release_tables(self, req: HookRequest) -> None:
        if req.steer_share is not None:
            digest, req.steer_share = req.steer_share, None
            shared = self.shared_steering[digest]
            shared.refs -= 1
            if shared.refs == 0:
                del self.shared_steering[digest]
                for row, refs in shared.vec_rows:
                    self.tables.release_vector(row, refs)
                if shared.op_rows:
                    self.tables.release_ops(shared.op_rows)
        for row, refs in req.vec_rows:
            self.tables.release_vector(row, refs)
        req.vec_rows = []
        if req.op_rows:
            self.tables.release_ops(req.op_rows)
        req.op_rows = []

    def _reactivate(self, req_id: str) -> None:
        req = self.requests[req_id]
        if req.fetched and req.hooks is None:     # preempted after its early fetch: nothing to route
            return
        if req.routes.steer or req.routes.capture or req.hooks:
            self.active[req_id] = req

    def _finish(self, req_id: str) -> None:
        req = self.requests.pop(req_id, None)
        self.active.pop(req_id, None)
        if req is None:
            return
        self._release_tables(req)
        self._attn_reqs -= bool(req.attn_jobs)
        req.finished_at = time.monotonic()
        self._finish_hooks(req)
        if req.key and not req.fetched and (req.routes.capture or req.errors or req.hook_results):
            self.done[req_id] = req

    def _finish_hooks(self, req: HookRequest) -> None:
        """Its hooks run no more: their results go to host memory (persistent ones to their
        store). At finish, or at the fetch, which may come first (vLLM tells workers that a
        request finished only in the next step)."""
        if req.hooks is not None:
            self.hooked.pop(req.req_id, None)
            req.hook_results = self.hooks.finish(req.req_id, req.hooks)
            req.hooks = None

    def _expire(self) -> None:
        now = time.monotonic()
        ttl = self.cfg.result_ttl_s
        expired = [r for r, q in self.done.items() if now - (q.finished_at or now) > ttl]
        if expired and self.prepared:
            self.prepared.drop([self.done[r].key for r in expired])
        for rid in expired:
            del self.done[rid]

    @property
    def tracks_blocks(self) -> bool:
        return self._attn_reqs > 0

    # ---- per step --------------------------------------------------------------------------
    def wants_step(self) -> bool:
        return bool(self.active) or self._steer_dirty > 0

    def begin_step(self, view: StepView) -> None:
        """Write this step's routing. Called after the runner prepared inputs, before forward."""
        self._step = self._repeated = None
        if not self.active and not self._steer_dirty:
            return
        with one_thread():
            self._begin_step(view)

    def _begin_step(self, view: StepView) -> None:
        t0 = time.perf_counter()
        try:
            self.collector.drain()
            self.timing["drain_s"] += time.perf_counter() - t0
            self._repeated = self.repeat.next(view)
            if self._repeated is None:
                self._route(view)
            else:
                self.timing["repeated_steps"] += 1
        except Exception as e:
            self.repeat.forget()
            self._repeated = None
            log.exception("vllm_hook: routing failed; this step runs unhooked")
            for r in self.active.values():
                _note(r.errors, f"internal error in vllm_hook routing: {e!r}")
            self._reset_steering(view.num_tokens_padded)
        if self.hooked and not (self._repeated is not None and self.hooks.advance()):
            self._plan_hooks(view)
        self.timing["hooked_steps"] += 1
        self._count_host(t0, self._repeated is not None)

    def _plan_hooks(self, view: StepView) -> None:
        try:
            qsl, computed = view.query_start_loc.tolist(), view.num_computed.tolist()
            entries = []
            for rid, req in self.hooked.items():
                i = view.index.get(rid)
                if i is not None and req.hooks is not None:
                    entries.append((req.hooks, qsl[i], qsl[i + 1] - qsl[i], computed[i]))
            self.hooks.plan(entries)
        except Exception as e:
            log.exception("vllm_hook: planning hooks failed; no hook runs in this step")
            self.hooks.forget()
            for req in self.hooked.values():
                _note(req.errors, f"internal error in vllm_hook planning hooks: {e!r}")

    def hooks_in(self, scheduled) -> int:
        """Which Python hooks run in the step that schedules `scheduled` (request ids): 0 none,
        1 read-only ones only (a FULL graph's read-only twin may run the step, and them after
        it), 2 some that may write (no plain FULL graph replay: it runs no Python)."""
        if not self.hooked:
            return 0
        kind = 0
        for rid in scheduled:
            req = self.hooked.get(rid)
            if req is not None and req.hooks is not None:
                if not req.hooks.read_only:
                    return 2
                kind = 1
        return kind

    def _count_host(self, t0: float, repeated: bool) -> None:
        dt = time.perf_counter() - t0
        self.timing["step_host_s"] += dt
        if repeated:
            self.timing["repeated_s"] += dt

    def _route(self, view: StepView) -> None:
        self.tables.flush()
        T_pad = view.num_tokens_padded
        if T_pad > self.bufs.shape.max_tokens:
            raise RuntimeError(f"step has {T_pad} rows, buffers hold {self.bufs.shape.max_tokens}")
        entries, finished_routing = [], []
        self._finishing = []
        qsl, computed = view.query_start_loc.tolist(), view.num_computed.tolist()   # one conversion
        for req in self.active.values():
            i = view.index.get(req.req_id)
            if i is None:
                continue
            rows = Rows(qsl[i], qsl[i + 1] - qsl[i], computed[i])
            entries.append((req, req.routes, rows))
            if rows.first_pos + rows.count - 1 >= req.horizon:
                finished_routing.append(req.req_id)
        has_steer = any(e[1].steer for e in entries)
        has_cap = any(e[1].capture for e in entries)
        op_h, cap_h = self.staging.begin()
        op_n = max(T_pad, self._steer_dirty) if (has_steer or self._steer_dirty) else 0
        if op_n > T_pad:
            op_h[T_pad:op_n] = 0
        if has_cap:
            self.staging.clear_captures(cap_points(cap_h), self._trash)
        # Without steering (capture) routes, route_step writes nothing into op_h (cap_h); it
        # zeroes the rows below min(op_n, T_pad) that it does not write whole.
        try:
            routing = route_step(entries, op_h[:T_pad], cap_points(cap_h[:T_pad]), self.bufs.shape.pool_rows,
                                 zero_upto=min(op_n, T_pad), broadcast_from=self.staging.broadcast_from)
        except Exception:
            entries = self._without_culprits(entries, op_h, cap_h, T_pad)
            if op_n:
                op_h[:op_n] = 0
            if has_cap:
                self.staging.clear_captures(cap_points(cap_h), self._trash, whole=True)
            routing = route_step(entries, op_h[:T_pad], cap_points(cap_h[:T_pad]), self.bufs.shape.pool_rows,
                                 broadcast_from=self.staging.broadcast_from)
        if has_cap:
            self.staging.wrote(routing.cap_written)
        self.staging.commit(op_n, T_pad if routing.segments else 0, routing.broadcast)
        self._steer_dirty = routing.steered_upto
        for req in routing.overflow:
            msg = (f"capture incomplete: one step needed more than capture_pool_rows="
                   f"{self.bufs.shape.pool_rows} rows; raise additional_config "
                   "vllm_hook.capture_pool_rows or lower max_num_batched_tokens")
            _note(req.errors, msg)
        for rid in finished_routing:
            req = self.active.pop(rid, None)
            if req is not None:
                self._finishing.append(req)
        self.repeat.remember(view, routing, entries, routes_changed=bool(finished_routing))
        self._step = routing
        self.steps_routed += 1

    def _without_culprits(self, entries, op_h, cap_h, T_pad: int):
        """The entries that route on their own (into scratch arrays); the others fail."""
        keep = []
        for e in entries:
            try:
                route_step([e], np.zeros_like(op_h[:T_pad]), cap_points(np.empty_like(cap_h[:T_pad])),
                           self.bufs.shape.pool_rows)
                keep.append(e)
            except Exception as err:
                log.exception("vllm_hook: routing request %s failed; it runs unhooked", e[0].req_id)
                self._fail(e[0].req_id, f"internal error in vllm_hook routing: {err!r}")
        return keep

    def _reset_steering(self, T_pad: int) -> None:
        n = max(T_pad, self._steer_dirty)
        if n:
            self.bufs.op_idx[:n].zero_()
        self._steer_dirty = 0

    def end_step(self) -> None:
        """After the forward was queued: compute attention weights where asked, queue copies."""
        if self.hooks is not None:
            self.hooks.clear_plan()
        step, self._step = self._step, None
        repeated, self._repeated = self._repeated, None
        if step is None and repeated is None:
            return
        with one_thread():
            self._end_step(step, repeated)

    def _end_step(self, step, repeated) -> None:
        t0 = time.perf_counter()
        try:
            if repeated is not None:
                step = repeated[0]
                self.collector.after_repeat(*repeated)
                return
            extras = []
            if any(seg.owner.attn_jobs for seg in step.segments):
                extras = scores_for_step(step, self.bufs.pools[POOL_Q], self.attn_layers)
            self.collector.after_forward(step, extras)
            finishing, self._finishing = self._finishing, []
            if finishing:
                self._prepare(finishing)
        except Exception as e:
            log.exception("vllm_hook: capture copy failed")
            for seg in step.segments:
                _note(seg.owner.errors, f"internal error copying captures: {e!r}")
        finally:
            self._count_host(t0, repeated is not None)

    def _budget_room(self, nbytes: int) -> bool:
        return self.budget.used + nbytes <= self.budget.limit

    def _deliver(self, seg: Segment, rows: torch.Tensor, blocked: bool = False) -> None:
        req: HookRequest = seg.owner
        if req.fetched or req.capture_dropped:
            return
        if not req.store.add(seg.points, seg.positions, rows, seg.last_only, blocked):
            # Bounded memory: this request loses its captures, the others keep theirs.
            req.capture_dropped = True
            req.store = RequestStore()
            self.timing["captures_dropped"] += 1
            _note(req.errors, f"captures dropped: with the other unfetched results on this worker "
                  f"they would pass max_inflight_capture_bytes ({self.budget.limit} bytes); fetch "
                  "results sooner, capture less, or raise additional_config "
                  "vllm_hook.max_inflight_capture_bytes")

    # ---- RPC -------------------------------------------------------------------------------
    def _take(self, keys: list[str], running: bool = False):
        """Every unfetched request (n>1: every child) with one of `keys`, marked fetched and
        forgotten as it is yielded. Their copies still in flight are waited for, not the other
        requests' (a request may be fetched while the batch decodes: `FetchBatcher.hold`).
        `running`: fetched while they decode (their spec has no hooks of its own); hooks they
        run still (persistent ones, registered after the frontend admitted them) go on until
        their finish, their results to the persistent store."""
        wanted = set(keys)
        # Finished requests (the common case) were released at their finish: they leave
        # `done` as they are taken. Requests still running (vLLM tells workers of a finish in
        # the next step; or fetched once their prompt was done) are never routed again.
        taken = [(rid, req) for rid, req in self.done.items() if req.key in wanted and not req.fetched]
        taken += [(rid, req) for rid, req in self.requests.items() if req.key in wanted and not req.fetched]
        self.collector.settle({req for _, req in taken})
        for rid, _ in taken:
            self.done.pop(rid, None)
        for rid, req in taken:
            if req.hooks is not None and running and rid in self.requests:
                req.fetched = True
                yield rid, req, self._take_store(req)
                continue
            if req.hooks is not None:
                self._finish_hooks(req)
            if rid in self.active:
                del self.active[rid]
            req.fetched = True
            yield rid, req, self._take_store(req)

    @staticmethod
    def _take_store(req: HookRequest) -> RequestStore:
        store, req.store = req.store, RequestStore()
        return store

    def fetch(self, keys: list[str], spill: dict | None = None, arenas: list[str] = (),
              running: bool = False) -> dict[str, Any]:
        """Results of every request with one of `keys`, as one safetensors payload (bytes,
        or a file in `spill`'s directory when the frontend shares it, `delivery.spill`):
        {"batch": payload, "entries": {key: [{"req_id", "j"}]}}, j the request's part.
        Rows in this worker's arena are lent when the frontend has mapped it (its token in
        `arenas`); else the reply offers the arena ("arena")."""
        with no_gc(), one_thread():
            return self._fetch(keys, spill, arenas, running)

    def _fetch(self, keys: list[str], spill: dict | None, arenas: list[str] = (),
               running: bool = False) -> dict[str, Any]:
        t0, t0_mono = time.perf_counter(), time.monotonic()
        self._lent_to = tuple(arenas or ())
        prepared = self._claim(keys) if self.prepared else []
        if not prepared:
            reply = self._reply(keys, list(self._take(keys, running)), spill)
        else:
            # Their requests taken; the rest answered now, beside them
            try:
                covered = frozenset().union(*(p.keys for p in prepared))
                rest = [t for t in self._take(keys, running) if t[1].key not in covered]
                reply = self._reply([k for k in keys if k not in covered], rest, spill)
            except BaseException:
                self.prepared.discard(prepared)        # not sent: their pieces stay here
                raise
            reply["more"] = [{"batch": p.reply["batch"], "entries": p.reply["entries"]} for p in prepared]
        self.timing["fetches"] += 1
        self.timing["fetch_s"] += time.perf_counter() - t0
        # When it ran (the host's monotonic clock): the frontend splits its RPC's time into
        # the way here (waiting, e.g., for a step in flight) and the way back.
        reply["ran"] = (t0_mono, time.monotonic())
        return reply

    def _reply(self, keys, taken: list[tuple[str, HookRequest, RequestStore]], spill: dict | None,
               lend_only: bool = False) -> dict[str, Any]:
        """The fetch reply for `taken` (request id, request, its rows): one payload, rows in the
        arena lent when the frontend mapped it. `lend_only`: nothing but positions by value
        (`NotLent` else; `_prepare`)."""
        entries: dict[str, list[dict]] = {k: [] for k in keys}
        parts = []
        common = {"rank": self.rank, "pp_rank": self.pp_rank,
                  "q_heads": {str(i.layer): i.q_heads for i in self.attn_layers if i is not None},
                  "kv_heads": {str(i.layer): i.kv_heads for i in self.attn_layers if i is not None}}
        for rid, req, store in taken:
            meta = {"req_id": rid, "prompt_len": req.prompt_len}
            if req.errors:                      # most have none: not sent
                meta["errors"] = list(req.errors)
            if req.attn_heads:
                meta["attn_heads"] = {str(k): v for k, v in req.attn_heads.items()}
            extra = self._hook_tensors(req, meta) if req.hook_results is not None else None
            entries[req.key].append({"req_id": rid, "j": len(parts)})
            parts.append((meta, store._tensors(extra, pos_arrays=True, views_only=lend_only)))
        if self.off:        # requests this worker never saw (admission was what failed)
            for k in [k for k, e in entries.items() if not e]:
                entries[k].append({"req_id": k, "j": len(parts)})
                parts.append(({"req_id": k, "errors": [self._off_message()], "rank": self.rank}, {}))
        t1 = time.perf_counter()
        arena = self.collector.arena
        lends = arena is not None and arena.token.hex() in self._lent_to
        payload = (batch_to_wire(parts, spill, common, arena if lends else None, lend_only)
                   if parts else None)
        if not lend_only:                   # made ahead: in prepare_s
            self.timing["write_s"] += time.perf_counter() - t1
        reply = {"batch": payload, "entries": entries,
                 "arena_token": arena.token.hex() if arena is not None else None}
        if arena is not None and not lends:
            reply["arena"] = arena.offer()
        return reply

    def _prepare(self, reqs: list[HookRequest]) -> None:
        """Make now, while the device runs this step, the fetch reply of the requests whose
        routes it ended (`worker.prepared`): those with rows or errors to fetch, no hooks, and
        every request of their keys among them; only where the frontend maps the arena and
        every row of theirs lies there (lent, never read: the device is still writing them)."""
        arena = self.collector.arena
        if (arena is None or arena.token.hex() not in self._lent_to or self.off
                or (self.hooks is not None and self.hooks.persistent)):
            return
        t0 = time.perf_counter()
        try:
            # Not a request whose generated tokens' rows came in decode steps: those rows are
            # not lent from the arena (its reply could not be made, `NotLent`).
            take = [r for r in reqs if r.key and not r.fetched and r.hooks is None and r.hook_results is None
                    and not r.attn_jobs and (r.routes.capture or r.errors)
                    and (r.routes.horizon < float("inf") or r.horizon < r.prompt_len)]
            if not take:
                return
            keys = {r.key for r in take}
            if sum(self._unfetched(keys).values()) != len(take) or not self.collector.hand_over_early(set(take)):
                return
            with no_gc():
                try:
                    reply = self._reply(sorted(keys), [(r.req_id, r, r.store) for r in take], None, lend_only=True)
                except NotLent:
                    return
            self.prepared.add(Prepared(frozenset(keys), reply,
                                       [(r, r.store, r.store.version, len(r.errors)) for r in take]))
        except Exception:
            log.exception("vllm_hook: preparing a fetch reply failed; it is made at the fetch")
        finally:
            self.timing["prepare_s"] += time.perf_counter() - t0

    def _unfetched(self, keys) -> dict[str, int]:
        """The worker's unfetched requests with one of `keys`, per key."""
        out: dict[str, int] = {}
        for reqs in (self.requests, self.done):
            for r in reqs.values():
                if r.key in keys and not r.fetched:
                    out[r.key] = out.get(r.key, 0) + 1
        return out

    def _claim(self, keys: list[str]) -> list[Prepared]:
        """The prepared replies within `keys`, still valid (`PreparedReplies.claim`), for a
        fetch whose frontend maps the arena they lend from. The requests' copies in flight
        are handed over first (`settle`): rows routed after a reply was made (a preempted
        request's recompute) make it stale."""
        arena = self.collector.arena
        if self.off or arena is None or arena.token.hex() not in self._lent_to:
            self.prepared.drop(keys)
            return []
        want = set(keys)
        owners = {r for reqs in (self.requests, self.done) for r in reqs.values() if r.key in want and not r.fetched}
        self.collector.settle(owners)
        unfetched: dict[str, int] = {}
        for r in owners:
            unfetched[r.key] = unfetched.get(r.key, 0) + 1
        return self.prepared.claim(want, unfetched)

    def _hook_tensors(self, req: HookRequest, meta: dict) -> dict[str, torch.Tensor]:
        """The request's hook results: their tensors, and their structure into `meta`."""
        if req.hook_results is None:
            return {}
        trees, event = req.hook_results
        req.hook_results = None
        if event is not None:
            event.synchronize()
        try:
            tensors, meta["hooks"] = encode(trees, HOOK_TENSOR_PREFIX)
        except StateError as e:
            meta["errors"] = [*meta.get("errors", ()), f"hook results could not be delivered: {e}"]
            return {}
        return tensors

    def persistent_hooks(self, op: str, *args, ids=lambda r: r):
        """The persistent-hook RPCs (register, collect, clear results, clear, prefetch).
        `ids` maps a worker's request id to the caller's. Failures come back as {"error"}."""
        if self.hooks is None:
            return {"error": "this engine has no hook layers: start it with additional_config "
                             'vllm_hook.hook_layers (a list of layers or "all")'}
        h = self.hooks
        try:
            if op == "register_hooks":
                return h.register([h.build(e) for e in args[0]])
            if op == "collect_hooks":
                done = set(args[0]) if args else set()
                for rid, req in list(self.hooked.items()):
                    if ids(rid) in done:        # finished, though this worker has not heard yet
                        self._finish_hooks(req)
                if self.rank != 0:
                    return {}
                return {"blob": encode_collected({ids(r): t for r, t in h.collect().items()}), "pp_rank": self.pp_rank}
            if op == "clear_hook_results":
                return h.clear_results()
            if op == "clear_hooks":
                h.clear()
                return 0
            if op == "prefetch_params":
                return h.access.prefetch(list(args[0]))
        except (KeyError, ValueError, TypeError, StateError) as e:
            return {"error": str(e.args[0]) if e.args else repr(e)}
        raise ValueError(op)

    def discard(self, keys: list[str]) -> int:
        """Drop the results of aborted requests, unserialised."""
        self.prepared.drop(keys)
        return sum(1 for _ in self._take(keys))

    def register_vectors(self, vectors: dict[str, bytes]) -> list[str]:
        for name, raw in vectors.items():
            self.named[name] = np.frombuffer(raw, dtype=np.float32).copy()
        return sorted(self.named)

    def delete_vectors(self, names: list[str]) -> list[str]:
        for n in names:
            self.named.pop(n, None)
        return sorted(self.named)

    def stats(self) -> dict[str, Any]:
        return {
            "admitted": len(self.requests),
            "active": len(self.active),
            "results_waiting": len(self.done),
            "retained_bytes": sum(r.store.nbytes for r in list(self.done.values()) + list(self.requests.values())),
            "capture_bytes_in_flight": self.budget.used, "max_inflight_capture_bytes": self.budget.limit,
            "vectors_in_use": self.tables.vectors_in_use,
            "ops_in_use": self.tables.ops_in_use,
            "named_vectors": len(self.named),
            "copies_in_flight": self.collector.in_flight,
            "blocks_widened": self.collector.widened,      # captured blocks sent in float32
            "device_buffer_bytes": self.bufs.nbytes(),
            "steps_routed": self.steps_routed,
            "hooked": len(self.hooked),
            "persistent_hooks": len(self.hooks.persistent) if self.hooks else 0,
            "persistent_hook_results": len(self.hooks.persistent_results) if self.hooks else 0,
            "timing": {**self.timing, **(self.hooks.timing if self.hooks else {}),
                       # fetch replies made ahead (`_prepare`): used by a fetch, made, dropped unused
                       "fetches_prepared": self.prepared.used, "prepared_made": self.prepared.made,
                       "prepared_dropped": self.prepared.dropped,
                       # the host waiting for the device's copies: routing arrays, captured rows
                       "wait_staging_s": self.staging.wait_s, "wait_copies_s": self.collector.wait_s,
                       **process_clock().counters()},
            "torch_threads": torch.get_num_threads(),     # host ops' parallelism on this worker
            **(self.collector.arena.stats() if self.collector.arena is not None else {}),
        }
