"""Python's cyclic collector paused around delivery work."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def no_gc():
    """Pause the cyclic collector while a batch's results are packed (worker) or built
    (frontend): both allocate many small objects and no cycles, and a full collection over a
    large heap, triggered by those allocations, cost more than the work itself (frontend build
    230 µs per request, worker fetch 270, at 256 requests: benchmarks/host_cost.py)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
