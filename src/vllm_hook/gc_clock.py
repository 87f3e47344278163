"""Seconds this process spends in Python's cyclic collector.

Reported beside the plugin's stage counters (`stats()`, `GET /v1/hook/health`: the frontend's
process and rank 0's): a full collection of a server's heap can take tens of milliseconds,
wherever an allocation happens to trigger it, and no stage counts it.
"""

from __future__ import annotations

import gc
import os
import time


class GcClock:
    """Registered on creation; its figures only grow: a span's are the difference of two reads."""

    def __init__(self) -> None:
        self.total = 0.0            # seconds
        self.collections = 0
        self.full = 0               # of the oldest generation
        self._start = 0.0
        gc.callbacks.append(self._on)
        # A forked child (vLLM's workers, where forked) counts its own time from zero.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self.total, self.collections, self.full = 0.0, 0, 0

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.total += time.perf_counter() - self._start
        self.collections += 1
        if info.get("generation") == 2:
            self.full += 1

    def counters(self) -> dict[str, float]:
        return {"gc_s": self.total, "gc_collections": self.collections, "gc_full_collections": self.full}


_PROCESS: GcClock | None = None


def process_clock() -> GcClock:
    """This process's clock (one per process, made on first use)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = GcClock()
    return _PROCESS
