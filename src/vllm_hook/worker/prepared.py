"""Fetch replies made while the device still runs the step that ends their requests' routing.

A request whose routes end at a known position (a prompt's last-token capture: its horizon)
has all its rows once the step that routes that position is queued. The worker makes the
fetch reply for that step's such requests right then (`HookRuntime._prepare`), while the
device computes the step and the engine waits for it, instead of after the frontend's fetch
arrives: the reply leaves as soon as the fetch does. A reply made this early may only lend
rows from the arena (`batch_to_wire(lend_only=True)`), never read them: the device is still
writing them; the fetch that claims it waits for their copies (`Collector.settle`) first.

A prepared reply is used by a fetch of all its requests (and maybe others: a batch whose
prompts took several steps has a reply per step), unchanged since (no rows added, no error
noted, none fetched): the fetch's reply carries it as it is, beside a payload made then for
the rest ("more"). A fetch of some of them drops it (its lent pieces back to the arena) and
is answered as before. At most `MAX_PREPARED` are kept (the oldest dropped): a batch's
prefill steps, and with asynchronous scheduling the engine may queue the next step before
the fetch of this one arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

MAX_PREPARED = 16


@dataclass(eq=False)
class Prepared:
    keys: frozenset
    reply: dict[str, Any]
    # (request, its store, the store's version, its error count) when made
    state: list[tuple[Any, Any, int, int]]

    def unchanged(self) -> bool:
        return all(not req.fetched and req.store is store and store.version == version
                   and len(req.errors) == errors and req.hooks is None and req.hook_results is None
                   for req, store, version, errors in self.state)


class PreparedReplies:
    """The prepared replies of one worker, oldest first."""

    def __init__(self, arena: Any):
        self.arena = arena
        self._items: list[Prepared] = []
        self.made = self.used = self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, p: Prepared) -> None:
        for old in [q for q in self._items if q.keys & p.keys]:
            self._drop(old)
        self._items.append(p)
        self.made += 1
        while len(self._items) > MAX_PREPARED:
            self._drop(self._items[0])

    def claim(self, keys: Iterable[str], unfetched: dict[str, int]) -> list[Prepared]:
        """The prepared replies within `keys`, still valid, taken out; every other one holding
        one of `keys` is dropped (its requests are fetched now, answered at the fetch).
        `unfetched`: the worker's unfetched requests per key (a reply holds all of its keys':
        none left out, such as another child of an n > 1 request)."""
        want = frozenset(keys)
        hits = []
        for p in [q for q in self._items if q.keys & want]:
            self._items.remove(p)
            if p.keys <= want and p.unchanged() and sum(unfetched.get(k, 0) for k in p.keys) == len(p.state):
                hits.append(p)
            else:
                self._discard(p)
        self.used += len(hits)
        return hits

    def drop(self, keys: Iterable[str] | None = None) -> None:
        """Drop the replies holding one of `keys` (all when None)."""
        want = None if keys is None else frozenset(keys)
        for p in [q for q in self._items if want is None or q.keys & want]:
            self._drop(p)

    def discard(self, claimed: list[Prepared]) -> None:
        """Claimed replies that will not be sent after all (the fetch failed)."""
        for p in claimed:
            self._discard(p)

    def _drop(self, p: Prepared) -> None:
        self._items.remove(p)
        self._discard(p)

    def _discard(self, p: Prepared) -> None:
        self.dropped += 1
        refs = (p.reply.get("batch") or {}).get("lent")
        if refs and self.arena is not None:
            self.arena.unlend(refs.values())
