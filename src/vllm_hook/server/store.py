"""Results too large to travel inline, kept in the API server until the client fetches them.

Bounded twice: an entry lives at most `result_ttl_s`, and the total never exceeds
`max_retained_bytes` (the oldest entries are dropped first). Clients delete what they fetched.

A client on the server's host may ask for its results as files (`put(local=True)`): the bytes
go into a file of their own in shared memory (`result_spill_dir`, mode 0600, an unguessable
name),
which the client reads without HTTP and then releases. Reading 3 MB through the async HTTP
client cost it 6 to 10 ms of CPU on the CI machine, the file 0.3; a served batch's every-token
captures are that client's CPU time (docs/benchmarks.md, run 154). The file's bytes count as
the entry's (shared memory is RAM); HTTP fetches of such an entry read the file. Where the
file cannot be written (no such directory, a container's 64 MB /dev/shm full), or with
`local_results` off, the bytes stay in memory and the entry has no path: the client fetches it
as before.
"""

from __future__ import annotations

import atexit
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

LOCAL_PREFIX = "vllm-hook-result-"     # then the server's pid, "-", the handle


@dataclass
class StoreStats:
    count: int
    bytes: int
    max_bytes: int
    ttl_s: float
    dropped: int
    local: int = 0                     # entries kept as files (`put(local=True)`)


class ResultStore:
    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic, local_dir: str | None = None):
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        # handle -> (deadline, bytes or None, file path or None, size); oldest first
        self._items: OrderedDict[str, tuple[float, bytes | None, str | None, int]] = OrderedDict()
        self._bytes = 0
        self._dropped = 0            # expired or evicted before anyone fetched them
        self._lock = threading.Lock()  # puts may come from encoding threads
        self.local_dir = local_dir if local_dir and os.access(local_dir, os.W_OK) else None
        if self.local_dir is not None:
            _sweep_expired(self.local_dir, ttl_s)
            # Files left at exit would hold shared memory until the host reboots.
            atexit.register(_unlink_all, weakref.ref(self))

    def put(self, data: bytes, local: bool = False) -> str | None:
        """Keep `data`; return its handle, or None when it alone exceeds the bound. `local`:
        in a file (`path`) where one can be written."""
        if len(data) > self.max_bytes:
            return None
        handle = secrets.token_urlsafe(18)   # unguessable: a handle is a read capability
        path = self._write(handle, data) if local and self.local_dir is not None else None
        with self._lock:
            self._expire()
            while self._items and self._bytes + len(data) > self.max_bytes:
                self._drop(next(iter(self._items)))
            self._items[handle] = (self._clock() + self.ttl_s, None if path else data, path, len(data))
            self._bytes += len(data)
        return handle

    def _write(self, handle: str, data: bytes) -> str | None:
        path = os.path.join(self.local_dir, f"{LOCAL_PREFIX}{os.getpid()}-{handle}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except OSError:              # full: the bytes stay in memory
            _unlink(path)
            return None
        return path

    def path(self, handle: str) -> str | None:
        """The file holding the entry `handle`, if it is kept as one."""
        with self._lock:
            item = self._items.get(handle)
        return item[2] if item else None

    def get(self, handle: str) -> bytes | None:
        with self._lock:
            self._expire()
            item = self._items.get(handle)
        return _read(item) if item else None

    def pop(self, handle: str) -> bytes | None:
        """The result, removed: one round trip for a client that fetches it once."""
        with self._lock:
            self._expire()
            item = self._items.pop(handle, None)
            if item:
                self._bytes -= item[3]
        if not item:
            return None
        data = _read(item)
        if item[2]:
            _unlink(item[2])
        return data

    def delete(self, handle: str) -> bool:
        with self._lock:
            self._expire()
            item = self._items.pop(handle, None)
            if item:
                self._bytes -= item[3]
        if item and item[2]:
            _unlink(item[2])
        return item is not None

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire()
            return StoreStats(len(self._items), self._bytes, self.max_bytes, self.ttl_s, self._dropped,
                              sum(1 for item in self._items.values() if item[2]))

    def _expire(self) -> None:
        now = self._clock()
        # Insertion order is expiry order (one TTL for all), so stop at the first live entry.
        while self._items:
            handle, item = next(iter(self._items.items()))
            if item[0] > now:
                break
            self._drop(handle)

    def _drop(self, handle: str) -> None:
        _, _, path, size = self._items.pop(handle)
        self._bytes -= size
        self._dropped += 1
        if path:
            _unlink(path)


def _read(item: tuple) -> bytes | None:
    if item[2] is None:
        return item[1]
    try:
        with open(item[2], "rb") as f:
            return f.read()
    except OSError:              # removed behind the server's back
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _unlink_all(ref: weakref.ref) -> None:
    store = ref()
    if store is not None:
        with store._lock:
            paths = [item[2] for item in store._items.values() if item[2]]
        for p in paths:
            _unlink(p)


def _sweep_expired(directory: str, ttl_s: float) -> None:
    """Remove result files older than `ttl_s`: a crashed server's (it skips `atexit`). Not by
    whether their server runs: servers in containers sharing /dev/shm (`--ipc=host`) do not
    see each other's pids, and a live server's files expire within `ttl_s` anyway."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(LOCAL_PREFIX)]
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            if now - os.stat(path).st_mtime > ttl_s:
                os.unlink(path)
        except OSError:
            pass
