"""Moves each step's captured rows from the device pool to per-request host stores.

On a GPU the copy is queued on the compute stream right after the forward, into pinned host
memory, with an event; nothing waits for it. Completed copies are handed to the stores at the
start of a later step or when results are fetched. The next forward may overwrite the pool
only after the copy, by stream order. On the CPU the pool already is host memory: copy now.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from ..routing import Segment, StepRouting

Deliver = Callable[[Segment, torch.Tensor], None]


class Collector:
    def __init__(self, pool: torch.Tensor, deliver: Deliver):
        self.pool = pool
        self.deliver = deliver
        self.on_device = pool.device.type != "cpu"
        self._pending: deque[tuple[object, torch.Tensor, list[Segment]]] = deque()
        self.bytes_copied = 0

    def after_forward(self, routing: StepRouting) -> None:
        n = routing.pool_used
        if not routing.segments or n == 0:
            return
        self.bytes_copied += n * self.pool.shape[1] * self.pool.element_size()
        if not self.on_device:
            self._hand_over(self.pool[:n].clone(), routing.segments)
            return
        host = torch.empty((n, self.pool.shape[1]), dtype=self.pool.dtype, pin_memory=True)
        host.copy_(self.pool[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host, routing.segments))

    def drain(self, wait: bool = False) -> None:
        while self._pending:
            event, host, segments = self._pending[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self._pending.popleft()
            self._hand_over(host, segments)

    def _hand_over(self, rows: torch.Tensor, segments: list[Segment]) -> None:
        for seg in segments:
            n = len(seg.positions)
            # clone: pinned memory is scarce; keep it only while the copy is in flight
            part = rows[seg.pool_start:seg.pool_start + n]
            self.deliver(seg, part.clone() if self.on_device else part)

    @property
    def in_flight(self) -> int:
        return len(self._pending)
