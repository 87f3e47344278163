"""Python's cyclic collector paused around delivery work."""

from __future__ import annotations

import gc


class no_gc:
    """Pause the cyclic collector while a batch's results are packed (worker) or built
    (frontend): both allocate many small objects and no cycles, and a full collection over a
    large heap, triggered by those allocations, cost more than the work itself (frontend build
    230 µs per request, worker fetch 270, at 256 requests: benchmarks/host_cost.py). A class,
    not a generator context manager: served, it is entered once per finished request."""

    __slots__ = ("was",)

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc) -> None:
        if self.was:
            gc.enable()
