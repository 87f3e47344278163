"""Decode steps that repeat the last step's routing: no routing on the host, nothing uploaded.

In steady decode the batch keeps its rows and every request moves one position on. Where each
hooked request's routes select the same at every further position (`RequestRoutes.steady_from`),
the device indexes written for the last step are already right for the next one, so a step
costs a comparison instead of a routing pass and two uploads (host time per step is what a
hooked batch adds to vLLM's; docs/benchmarks.md). Checked every step: the same request -> row
map and padded size, one row per request, every position one further. Lifecycle events
(admission, finish, resume) end the repetition: `forget`.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..adapters.base import StepView
from ..routing import RequestRoutes, Rows, StepRouting


class StepRepeat:
    def __init__(self) -> None:
        self._last: tuple[dict, int, list[int], StepRouting] | None = None
        self._k = 0

    def forget(self) -> None:
        self._last = None

    def remember(self, view: StepView, routing: StepRouting,
                 entries: Iterable[tuple[Any, RequestRoutes, Rows]], routes_changed: bool) -> None:
        """After a full routing pass: keep it if the next step may repeat it."""
        self._last = None
        if routes_changed or routing.overflow or view.num_tokens != len(view.index):
            return
        for owner, routes, rows in entries:
            if rows.count != 1 or rows.first_pos < routes.steady_from or owner.attn_jobs:
                return
        # Copies: V1's index is the runner's live dict, its positions a live array. Positions
        # as a list: comparing 16 ints in Python is several times cheaper than numpy's calls.
        self._last = (dict(view.index), view.num_tokens_padded, view.num_computed.tolist(), routing)
        self._k = 0

    def next(self, view: StepView) -> tuple[StepRouting, int] | None:
        """(the remembered routing, steps since it) if this step repeats it, else None (route
        it in full). The positions of repetition k are the routing's plus k."""
        last = self._last
        if last is None:
            return None
        index, padded, computed, routing = last
        k = self._k + 1
        if (view.num_tokens_padded != padded or view.num_tokens != len(index) or view.index != index
                or view.num_computed.tolist() != [c + k for c in computed]):
            self._last = None
            return None
        self._k = k
        return routing, k
