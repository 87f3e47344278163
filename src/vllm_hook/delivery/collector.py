"""Moves each step's captured rows from the device pools to per-request host stores.

On a GPU the copies are queued on the compute stream right after the forward, into pinned
host memory, with one event; nothing waits for them. Completed copies are handed to the
stores at the start of a later step or when results are fetched. The next forward may
overwrite the pools only after the copies, by stream order. On the CPU the pools already are
host memory: copy now. Besides pool rows, a step may deliver tensors computed after the
forward (attention weights): `extras`. A pool's block whose every capture takes its rows in
float32 from its prompt alone (offline, wire "W") is converted on the device before its copy
(where the in-flight budget has room for its float32 rows, and the arena does or it is small).

A step of 64 KiB and more (a prompt's rows) is copied into the worker's shared arena
(`arena`) when it has room: its rows stay there, and a fetch lends them to the frontend. Else
a large step stays in its pinned buffer until the results are fetched,
instead of being copied out: a copy into fresh host memory costs page faults, and the fetch
can write the file it sends from pinned memory as well as from any. Pinned memory is locked
RAM, so this holds at most KEEP_PINNED_BYTES at a time; beyond it, and for the small blocks of
decode steps, rows are copied out as soon as their copy completes. Decode steps that repeat
one routing are gathered per run (`runs.DecodeRun`), not handed over step by step.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque
from typing import Callable

import torch

from ..routing import Segment, StepRouting
from .arena import MIN_BLOCK_BYTES, Arena, make_arena
from .hostmem import copy_many, host_empty
from .runs import DecodeRun

Deliver = Callable[..., None]         # (segment, rows, blocked=False): `RequestStore.add`
WIDEN_SLICE_BYTES = 32 << 20   # the device's float32 temporary of a block widened (`_to_host`)
# A block to widen that the arena has no room for (none, or full) is widened only up to this
# size; a larger one goes in the model's dtype and its frontend widens it, as before "W".
# Outside the arena a block takes a fresh page-locked allocation and a write by value, twice
# as large in float32: run 151 (H100), every layer and token of 32 x 512-token prompts in
# float32 with the arena held by the previous batch's results, 1.4 s a batch at 64 MiB against
# 0.18 s when the arena took them.
WIDEN_OUTSIDE_ARENA_BYTES = 1 << 20
KEEP_PINNED_MIN = 4 << 20       # a step's pinned block this large is kept, not copied out
# At most this much kept at a time: a 16th of the host's memory, from 1 to 4 GiB (all layers
# and tokens of 32 x 512-token prompts of a 1.5B model are 1.4 GB in bf16; copying them out
# of pinned memory costs a page fault per page, the fetch's write reads them from either).
KEEP_PINNED_BYTES = min(4 << 30, max(1 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 16))


class Collector:
    def __init__(self, pools: list[torch.Tensor | None], deliver: Deliver, arena_bytes: int = 0,
                 widens: Callable[[object], bool] | None = None, room: Callable[[int], bool] | None = None):
        self.pools = pools
        self.deliver = deliver
        # Whether a segment's owner takes its rows in float32 (`_wide_pools`)
        self.widens = widens
        # Whether the worker's in-flight budget (max_inflight_capture_bytes) has room for n
        # more bytes: a block is widened only then (float32 rows count twice the model dtype's)
        self.room = room
        self.device = next(p for p in pools if p is not None).device
        self.on_device = self.device.type != "cpu"
        # Made now, not at the first large step: page-locking 4 GiB took 2.4 s on the H200
        # host, and the engine's steps stalled for it even on a thread of its own (run 51).
        self.arena: Arena | None = make_arena(arena_bytes, self.device) if arena_bytes else None
        # DecodeRun, or (event, hosts, segments, extras, segments handed over early)
        self._pending: deque = deque()
        self._run: DecodeRun | None = None  # the open run, last in _pending
        self.bytes_copied = 0
        self.widened = 0                    # blocks sent to the host in float32 (`_wide_pools`)
        self.pinned_kept = 0
        self.wait_s = 0.0                   # waiting for copies the device had not finished

    def after_repeat(self, template: StepRouting, step: int) -> None:
        """After the forward of the `step`-th repetition of `template` (`worker.repeat`)."""
        if not template.segments:
            return
        run = self._run
        if run is None or not run.follows(template, step):
            self.close_run()
            run = self._run = DecodeRun(template, step, self.pools, self.arena)
            self._pending.append(run)
        run.add()
        self.bytes_copied += run.step_bytes

    def close_run(self) -> None:
        """End the open run: it is handed over once its copies are done."""
        if self._run is not None:
            self._run.close()
            self._run = None

    def after_forward(self, routing: StepRouting, extras: list[tuple[Segment, torch.Tensor]] = ()) -> None:
        self.close_run()
        if not routing.segments and not extras:
            return
        hosts: dict[int, torch.Tensor] = {}
        blocks = {pid: self.pools[pid][:n] for pid, n in routing.pool_used.items() if n}
        wide = self._wide_pools(blocks, routing.segments) if self.widens is not None else ()
        arena = self._arena_for(sum(b.numel() * (4 if pid in wide else b.element_size())
                                    for pid, b in blocks.items()))
        for pid, block in blocks.items():
            hosts[pid] = self._to_host(block, arena, torch.float32 if pid in wide else None)
        self.widened += sum(hosts[pid].dtype != blocks[pid].dtype for pid in wide)
        extra_hosts = [(seg, self._to_host(t)) for seg, t in extras]
        if not self.on_device:
            self.drain()        # a closed run first: its steps came before this one
            self._hand_over(hosts, routing.segments, extra_hosts)
            return
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, hosts, routing.segments, extra_hosts, []))

    def _wide_pools(self, blocks: dict[int, torch.Tensor], segments: list[Segment]) -> set[int]:
        """The pools whose block this step goes to the host in float32: every segment in it is
        of an owner that takes its rows so (`widens`: an offline float32 request whose rows all
        come from its prompt). Widened on the device instead of by the frontend on the host,
        where the mixed prefill-only batch's read took 63 µs a hooked request against 7 in the
        model's dtype (run 149); the copy to the host doubles."""
        wide = {pid for pid, b in blocks.items() if b.dtype != torch.float32}
        for seg in segments:
            if seg.pool in wide and not self.widens(seg.owner):
                wide.discard(seg.pool)
                if not wide:
                    break
        return wide

    def _arena_for(self, nbytes: int) -> Arena | None:
        """The arena, for a step of `nbytes` worth placing there."""
        return self.arena if nbytes >= MIN_BLOCK_BYTES else None

    def _to_host(self, t: torch.Tensor, arena: Arena | None = None, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        """`t` in host memory (`dtype`: converted to it on the way where the in-flight budget
        has room for it and the arena takes it or it is small, WIDEN_OUTSIDE_ARENA_BYTES; else
        in its own dtype)."""
        dtype = dtype or t.dtype
        if dtype != t.dtype and self.room is not None and not self.room(t.numel() * dtype.itemsize):
            dtype = t.dtype
        host = arena.alloc(t.shape, dtype) if arena is not None else None
        if host is None and dtype != t.dtype and t.numel() * dtype.itemsize > WIDEN_OUTSIDE_ARENA_BYTES:
            dtype = t.dtype
            host = arena.alloc(t.shape, dtype) if arena is not None else None
        self.bytes_copied += t.numel() * dtype.itemsize
        if host is None and not self.on_device:
            host = host_empty(t.shape, dtype)
        if not self.on_device:
            copy_many([(host, t)])
            return host
        if host is None:
            host = torch.empty(t.shape, dtype=dtype, pin_memory=True)
        if dtype == t.dtype:
            host.copy_(t, non_blocking=True)         # page-locked: asynchronous
            return host
        # Converted on the device (a copy to the host cannot convert), a slice at a time: a
        # temporary of the caching allocator, reused for the next slice only after its copy,
        # by the stream's order, and at most WIDEN_SLICE_BYTES outside vLLM's memory profile.
        step = max(1, WIDEN_SLICE_BYTES // max(1, t[0].numel() * dtype.itemsize))
        for i in range(0, t.shape[0], step):
            host[i:i + step].copy_(t[i:i + step].to(dtype), non_blocking=True)
        return host

    def drain(self, wait: bool = False) -> None:
        if wait:
            self.close_run()
        while self._pending and self._drain_head(wait):
            pass

    def settle(self, owners: set) -> None:
        """Hand over every completed copy, and wait only for those holding rows of `owners`
        (requests being fetched): a request fetched while others run (`worker.runtime._take`)
        does not wait for their steps in flight."""
        self.drain()
        last = -1
        for i, item in enumerate(self._pending):
            if isinstance(item, DecodeRun):
                segs = item.template.segments
            else:
                segs = [*item[2], *(seg for seg, _ in item[3]), *item[4]]
            if any(seg.owner in owners for seg in segs):
                last = i
        if last < 0:
            return
        if self._run is not None and self._pending[last] is self._run:
            self.close_run()
        for _ in range(last + 1):
            self._drain_head(wait=True)

    def hand_over_early(self, owners: set) -> bool:
        """Hand the rows of `owners` (requests whose last step this is) to their stores now,
        before their copies complete, where that needs no host copy: every step in flight
        holding their rows holds them in the arena, as views (a prepared fetch reply lends
        them without reading them, `worker.runtime`). Oldest step first, so each store gets
        its rows in order; other requests' rows of those steps are handed over as before.
        The steps stay pending, to be waited for by the fetch (`settle`). False (nothing
        handed over) when one does not qualify."""
        plan = []
        for i, item in enumerate(self._pending):
            if isinstance(item, DecodeRun):
                if any(seg.owner in owners for seg in item.template.segments):
                    return False
                continue
            _, hosts, segments, extras, _ = item
            if any(seg.owner in owners for seg, _ in extras):
                return False
            mine = [seg for seg in segments if seg.owner in owners]
            if not mine:
                continue
            if self.arena is None or not all(self.arena.holds(hosts[seg.pool]) for seg in mine):
                return False
            plan.append((i, mine))
        for i, mine in plan:
            event, hosts, segments, extras, early = self._pending[i]
            for seg, part in zip(mine, _slices(hosts, mine)):
                self.deliver(seg, part)
            rest = [seg for seg in segments if seg.owner not in owners]
            self._pending[i] = (event, hosts, rest, extras, early + mine)   # waited for, not handed over again
        return True

    def _drain_head(self, wait: bool) -> bool:
        """Hand over the oldest pending copies once done (`wait`: waiting for them); whether
        they were."""
        head = self._pending[0]
        run = isinstance(head, DecodeRun)
        if not (head.ready() if run else head[0].query()):
            if not wait:
                return False
            t = time.perf_counter()
            if run:
                head.wait()
            else:
                head[0].synchronize()
            self.wait_s += time.perf_counter() - t
        self._pending.popleft()
        if run:
            head.hand_over(self.deliver, self._keep)
        elif head[2] or head[3]:             # (rows handed over early excepted: `hand_over_early`)
            self._hand_over(*head[1:4])
        return True

    def _hand_over(self, hosts, segments: list[Segment], extras) -> None:
        parts = self._keep_or_copy(hosts, segments) if self.on_device else _slices(hosts, segments)
        for seg, part in zip(segments, parts):
            self.deliver(seg, part)
        for seg, t in extras:
            self.deliver(seg, t)

    def _keep_or_copy(self, hosts: dict[int, torch.Tensor], segments: list[Segment]) -> list[torch.Tensor]:
        """Each segment's rows: views of the pinned block (kept), or copied out of it."""
        if self.arena is not None and all(self.arena.holds(h) for h in hosts.values()):
            return _slices(hosts, segments)      # the arena's blocks: views, lent at fetch
        size = sum(h.numel() * h.element_size() for h in hosts.values())
        large = size >= KEEP_PINNED_MIN
        if large and self.pinned_kept + size <= KEEP_PINNED_BYTES:
            parts = _slices(hosts, segments)
            for p in parts:
                n = p.numel() * p.element_size()
                self.pinned_kept += n
                weakref.finalize(p, self._release, n)     # when its store lets it go
            return parts
        if large:
            # Beyond the budget: each request's rows copied on their own, so no request's
            # rows keep a large block of others' alive.
            pairs = [(host_empty(p.shape, p.dtype), p) for p in _slices(hosts, segments)]
        else:
            # A decode step: one copy per pool for all its requests, whose rows are views of
            # it (held until the last of them is fetched: a small block).
            pairs = [(host_empty(h.shape, h.dtype), h) for h in hosts.values()]
            hosts = dict(zip(hosts, (d for d, _ in pairs)))
        copy_many(pairs)
        return [d for d, _ in pairs] if large else _slices(hosts, segments)

    def _keep(self, view: torch.Tensor, n: int) -> bool:
        """Whether a view of a run's (pinned) buffer may be kept (it holds the buffer until its
        store lets it go): within KEEP_PINNED_BYTES, counting `n` bytes for it."""
        if self.pinned_kept + n > KEEP_PINNED_BYTES:
            return False
        self.pinned_kept += n
        weakref.finalize(view, self._release, n)
        return True

    def _release(self, nbytes: int) -> None:
        self.pinned_kept -= nbytes

    @property
    def in_flight(self) -> int:
        return len(self._pending)


def _slices(hosts: dict[int, torch.Tensor], segments: list[Segment]) -> list[torch.Tensor]:
    """Each segment's rows of its pool's block."""
    return [hosts[seg.pool][seg.pool_start:seg.pool_start + seg.num_rows] for seg in segments]
