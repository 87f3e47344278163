"""Captured rows of repeated decode steps, gathered per run instead of per step and request.

A run is a sequence of decode steps that repeat one routing (`worker.repeat`): the same
segments, every position one further each step. Each step's pool rows go, by one
asynchronous copy per pool, into the next slot of a pinned buffer [steps, rows, width]; no
per-request work happens on the step path. When the run ends, each request's store gets its
rows of every step as a view of that buffer ([points, steps, width], strided). The buffer is
a block of the worker's shared arena (`delivery.arena`) where it has room: a fetch then lends
each request's views to the frontend, which reads them in place (no worker write, no frontend
read: the mixed batch's worker fetch was 480 µs a request of its batch at 64 x 128 + 128 on
the H200, run 69). Else pinned memory, which the fetch copies once, into the payload; copying
the rows out here too cost one more pass over every decode row, into fresh memory, per request
and run (host time per step is what a hooked batch adds to vLLM's, docs/benchmarks.md).
Pinned memory is bounded: beyond the collector's budget, and for "last" selections (two rows
of a whole buffer), rows are copied out. Each view is charged its share of the buffer's
capacity, so a run cut short cannot pin more than the budget says.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..routing import Segment, StepRouting
from .arena import MIN_BLOCK_BYTES, Arena
from .hostmem import host_empty

RUN_BYTES = 16 << 20     # pinned bytes per run; a run this full is closed and a new one opened
ARENA_RUN_BYTES = 256 << 20   # a run's room in the arena (at most an 8th of it), trimmed at close
MAX_STEPS = 256


class DecodeRun:
    def __init__(self, template: StepRouting, first_step: int, pools: list[torch.Tensor | None],
                 arena: Arena | None = None):
        self.template = template
        self.first_step = first_step          # steps after the template's own
        self.steps = 0
        self.closed = False
        used = {pid: n for pid, n in template.pool_used.items() if n}
        self.step_bytes = sum(n * pools[pid].shape[1] * pools[pid].element_size() for pid, n in used.items())
        self._src = {pid: pools[pid][:n] for pid, n in used.items()}
        on_device = next(iter(self._src.values())).device.type != "cpu"
        self._arena = arena
        self._bufs = self._in_arena(arena)
        self.in_arena = self._bufs is not None
        if self._bufs is None:
            self.capacity = self._capacity(RUN_BYTES)
            self._bufs = {pid: torch.empty((self.capacity, *src.shape), dtype=src.dtype, pin_memory=on_device)
                          for pid, src in self._src.items()}
        self._event = torch.cuda.Event() if on_device else None     # CPU: copies are done at once
        self._stream = torch.cuda.current_stream() if on_device else None   # the steps' stream

    def _capacity(self, nbytes: int) -> int:
        return max(1, min(MAX_STEPS, nbytes // max(self.step_bytes, 1)))

    def _in_arena(self, arena: Arena | None) -> dict[int, torch.Tensor] | None:
        """Buffers in the arena (page-locked there on a GPU) where it has room: room for
        MAX_STEPS steps, or ARENA_RUN_BYTES, the unused steps given back when the run closes
        (few long runs: a request's rows in few parts). None: pinned memory instead."""
        if arena is None:
            return None
        self.capacity = self._capacity(min(ARENA_RUN_BYTES, arena.size // 8))
        if self.capacity * self.step_bytes < MIN_BLOCK_BYTES:
            return None
        bufs = {}
        for pid, src in self._src.items():
            buf = arena.alloc((self.capacity, *src.shape), src.dtype)
            if buf is None:
                return None          # the others' ranges go back with their last view
            bufs[pid] = buf
        return bufs

    def follows(self, template: StepRouting, step: int) -> bool:
        """Whether `step` of `template` is this run's next step, with a slot for it."""
        return (not self.closed and template is self.template and step == self.first_step + self.steps
                and self.steps < self.capacity)

    def add(self) -> None:
        """Queue this step's copies (after its forward, on the compute stream)."""
        for pid, src in self._src.items():
            self._bufs[pid][self.steps].copy_(src, non_blocking=True)
        self.steps += 1

    def close(self) -> None:
        """No more steps. The event is recorded now, on the steps' stream, not per step: it
        covers every copy queued before it (and at most a later forward, a step's delay).
        An arena buffer's unused steps go back to the arena (no copy was queued there)."""
        if self._event is not None:
            self._event.record(self._stream)
        self.closed = True
        if self.in_arena:
            for buf in self._bufs.values():
                self._arena.trim(buf, self.steps * buf[0].numel() * buf.element_size())

    def ready(self) -> bool:
        return self.closed and (self._event is None or self._event.query())

    def wait(self) -> None:
        """Until the run's copies are done."""
        if self._event is not None:
            self._event.synchronize()

    def hand_over(self, deliver: Callable[..., None], keep: Callable[[torch.Tensor, int], bool] | None = None) -> None:
        """Each segment's rows of every step, [points, steps, width] point-major as the store
        keeps a chunk: a view of the run's buffer where `keep(view, bytes)` (the pinned budget)
        allows, else a copy. A view holds the whole buffer: it is charged its share of the
        buffer's capacity, not only of the steps it holds (a run cut short keeps a buffer
        sized for a full one). Views of a buffer in the arena are always kept: the arena
        bounds itself."""
        if self._event is not None:
            self._event.synchronize()
        S = self.steps
        share = self.capacity / max(S, 1)
        for seg in self.template.segments:
            G = len(seg.points)
            first = 0 if not seg.last_only else max(0, S - 2)   # "last" keeps the newest two
            rows = self._bufs[seg.pool][first:S, seg.pool_start:seg.pool_start + G].transpose(0, 1)  # [G, s, W]
            if seg.last_only or (not self.in_arena and (
                    keep is None or not keep(rows, int(rows.numel() * rows.element_size() * share)))):
                rows = host_empty(rows.shape, rows.dtype).copy_(rows)
            p0 = int(seg.positions[0]) + self.first_step + first
            deliver(Segment(seg.owner, seg.points, 0, np.arange(p0, p0 + S - first, dtype=np.int64),
                            seg.last_only, seg.pool, seg.rows), rows, blocked=True)
