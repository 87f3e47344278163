"""Seconds a benchmark process spends in Python's cyclic collector (`gc.callbacks`)."""

from __future__ import annotations

import gc
import time


class GcClock:
    """Registered on creation; `total` only grows: a span's time is the difference of two reads."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start
