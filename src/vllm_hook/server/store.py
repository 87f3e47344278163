"""Results too large to travel inline, kept in the API server until the client fetches them.

Bounded twice: an entry lives at most `result_ttl_s`, and the total never exceeds
`max_retained_bytes` (the oldest entries are dropped first). Clients delete what they fetched.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoreStats:
    count: int
    bytes: int
    max_bytes: int
    ttl_s: float
    dropped: int


class ResultStore:
    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic):
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()   # oldest first
        self._bytes = 0
        self._dropped = 0            # expired or evicted before anyone fetched them
        self._lock = threading.Lock()  # puts may come from encoding threads

    def put(self, data: bytes) -> str | None:
        """Keep `data`; return its handle, or None when it alone exceeds the bound."""
        if len(data) > self.max_bytes:
            return None
        handle = secrets.token_urlsafe(18)   # unguessable: a handle is a read capability
        with self._lock:
            self._expire()
            while self._items and self._bytes + len(data) > self.max_bytes:
                self._drop(next(iter(self._items)))
            self._items[handle] = (self._clock() + self.ttl_s, data)
            self._bytes += len(data)
        return handle

    def get(self, handle: str) -> bytes | None:
        with self._lock:
            self._expire()
            item = self._items.get(handle)
        return item[1] if item else None

    def pop(self, handle: str) -> bytes | None:
        """The result, removed: one round trip for a client that fetches it once."""
        with self._lock:
            self._expire()
            item = self._items.pop(handle, None)
            if item:
                self._bytes -= len(item[1])
        return item[1] if item else None

    def delete(self, handle: str) -> bool:
        return self.pop(handle) is not None

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire()
            return StoreStats(len(self._items), self._bytes, self.max_bytes, self.ttl_s, self._dropped)

    def _expire(self) -> None:
        now = self._clock()
        # Insertion order is expiry order (one TTL for all), so stop at the first live entry.
        while self._items:
            handle, (deadline, _) = next(iter(self._items.items()))
            if deadline > now:
                break
            self._drop(handle)

    def _drop(self, handle: str) -> None:
        _, data = self._items.pop(handle)
        self._bytes -= len(data)
        self._dropped += 1
