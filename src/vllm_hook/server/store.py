"""Results too large to travel inline, kept in the API server until the client fetches them.

Bounded twice: an entry lives at most `result_ttl_s`, and the total never exceeds
`max_retained_bytes` (the oldest entries are dropped first). Clients delete what they fetched.

A client on the server's host may ask for its results as files (`put(local=True)`): the bytes
go into a file of their own in shared memory (`result_spill_dir`, mode 0600), which the client
reads without HTTP and then releases. Reading 3 MB through the async HTTP client cost it 6 to
10 ms of CPU on the CI machine; a served batch's every-token captures are mostly that client's
CPU time (docs/benchmarks.md, runs 153 to 155 and "Stop 65"). A file's name holds its deadline
and a random token, not its handle (the directory can be listed by anyone on the host; the
handle is the read capability). The file's bytes count as the entry's (shared memory is RAM),
and files take at most a quarter of their file system (`spill.keep_limit`: other programs'
shared memory must not find it full). Where a file cannot be written (no such directory, no
room, `local_results` off) the bytes stay in memory and the entry has no path: the client
fetches it as before. HTTP fetches of a file-backed entry read the file.

A file whose entry goes (released, fetched, deleted, expired, evicted) is kept for the next
result instead of deleted, up to `FREE_KEEP_BYTES` (a quarter of the files' bound where that
is less): renamed to a name no entry holds (deadline 0), it keeps its pages, and a later
result claims it by renaming it to that result's name and writes into those pages, where a
new file's pages are each allocated and zeroed by the kernel first (3.1 MB: about 4 ms of
the writer's CPU on the CI machine, most of a served every-token result's cost there).
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

from ..delivery.spill import keep_limit, list_quietly, remove_quietly
from ..delivery.store import StParts

LOCAL_PREFIX = "vllm-hook-result-"     # then the deadline (Unix seconds), "-", a random token
MAX_RELEASE = 4096                     # handles per release call (`POST /v1/hook/results/release`)
FULL_BACKOFF_S = 10.0                  # after a write found no room, no file for this long
FREE_KEEP_BYTES = 1 << 30              # files kept for reuse (`_retire`), at most
FREE_KEEP_FILES = 1024


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
        self._file_bytes = 0
        self._dropped = 0            # expired or evicted before anyone fetched them
        self._full_until = 0.0
        self._free: list[tuple[int, str]] = []        # files kept for reuse: (size, path)
        self._free_bytes = 0
        self._free_limit = 0
        self._lock = threading.Lock()  # puts may come from encoding threads
        local_dir = os.path.abspath(local_dir) if local_dir else None
        self.local_dir = local_dir if local_dir and os.access(local_dir, os.W_OK) else None
        if self.local_dir is not None:
            self._file_limit = keep_limit(self.local_dir)
            self._free_limit = min(FREE_KEEP_BYTES, self._file_limit // 4)
            _sweep_expired(self.local_dir)
            # Files left at exit would hold shared memory until the host reboots.
            atexit.register(_unlink_all, weakref.ref(self))

    def put(self, data: bytes | StParts, local: bool = False) -> str | None:
        """Keep `data`; return its handle, or None when it alone exceeds the bound. `local`:
        in a file (`path`) where one can be written. `StParts` are written to the file from
        their tensors, or else joined into bytes."""
        if len(data) > self.max_bytes:
            return None
        handle = secrets.token_urlsafe(18)   # unguessable: a handle is a read capability
        path = self._write(data) if local and self.local_dir is not None else None
        if path is None and isinstance(data, StParts):
            data = data.to_bytes()
        gone: list[tuple[str, int]] = []
        with self._lock:
            self._expire(gone)
            while self._items and self._bytes + len(data) > self.max_bytes:
                self._drop(next(iter(self._items)), gone)
            self._items[handle] = (self._clock() + self.ttl_s, None if path else data, path, len(data))
            self._bytes += len(data)
        self._retire(gone)
        return handle

    def _write(self, data: bytes | StParts) -> str | None:
        """`data` in a file of its own (one kept for reuse where one is large enough, else a
        new one), or None (no room: in memory instead)."""
        with self._lock:
            if self._clock() < self._full_until or self._file_bytes + len(data) > self._file_limit:
                return None
            self._file_bytes += len(data)           # reserved; given back below if unwritten
            claim = min((f for f in self._free if f[0] >= len(data)), default=None)
            if claim is not None:
                self._free.remove(claim)
                self._free_bytes -= claim[0]
        name = f"{LOCAL_PREFIX}{int(time.time() + self.ttl_s) + 1}-{secrets.token_urlsafe(12)}"
        path = os.path.join(self.local_dir, name)
        try:
            fd = None
            if claim is not None:
                try:
                    os.rename(claim[1], path)       # its pages, under this result's name
                    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    os.ftruncate(fd, len(data))
                except OSError:                     # removed behind the server's back
                    if fd is not None:
                        os.close(fd)
                    remove_quietly(path)
                    fd = None
            if fd is None:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                if isinstance(data, StParts):
                    data.write(fd)
                else:
                    view = memoryview(data)
                    while len(view):
                        view = view[os.write(fd, view):]
            except OSError:
                remove_quietly(path)
                raise
            finally:
                os.close(fd)
        except OSError:              # full (a container's 64 MB /dev/shm): memory for a while
            with self._lock:
                self._file_bytes -= len(data)
                self._full_until = self._clock() + FULL_BACKOFF_S
            return None
        return path

    def path(self, handle: str) -> str | None:
        """The file holding the entry `handle`, if it is kept as one."""
        with self._lock:
            item = self._items.get(handle)
        return item[2] if item else None

    def get(self, handle: str) -> bytes | None:
        gone: list[tuple[str, int]] = []
        with self._lock:
            self._expire(gone)
            item = self._items.get(handle)
        self._retire(gone)
        data = _read(item) if item else None
        if item and data is None:    # its file removed behind the server's back
            self.delete(handle)
        return data

    def pop(self, handle: str) -> bytes | None:
        """The result, removed: one round trip for a client that fetches it once."""
        item = self._take(handle)
        if not item:
            return None
        data = _read(item)
        if item[2]:
            self._retire([(item[2], item[3])])
        return data

    def delete(self, handle: str) -> bool:
        item = self._take(handle)
        if item and item[2]:
            self._retire([(item[2], item[3])])
        return item is not None

    def _take(self, handle: str) -> tuple | None:
        gone: list[tuple[str, int]] = []
        with self._lock:
            self._expire(gone)
            item = self._items.pop(handle, None)
            if item:
                self._forget(item)
        self._retire(gone)
        return item

    def _retire(self, files: list[tuple[str, int]]) -> None:
        """Files of entries gone, (path, size) each: kept for reuse within the bound (under
        a name no entry holds, swept at the next start), else deleted. Not under the lock:
        a rename, and freeing a large file's pages, take a while."""
        for path, size in files:
            with self._lock:
                keep = (self._free_bytes + size <= self._free_limit and len(self._free) < FREE_KEEP_FILES)
                if keep:
                    self._free_bytes += size                   # reserved
            if keep:
                free = os.path.join(os.path.dirname(path), f"{LOCAL_PREFIX}0-{secrets.token_urlsafe(12)}")
                try:
                    os.rename(path, free)
                except OSError:                                 # removed behind the server's back
                    keep = False
                with self._lock:
                    if keep:
                        self._free.append((size, free))
                    else:
                        self._free_bytes -= size
            if not keep:
                remove_quietly(path)

    def stats(self) -> StoreStats:
        gone: list[tuple[str, int]] = []
        with self._lock:
            self._expire(gone)
            out = StoreStats(len(self._items), self._bytes, self.max_bytes, self.ttl_s, self._dropped,
                             sum(1 for item in self._items.values() if item[2]))
        self._retire(gone)
        return out

    def _expire(self, gone: list[tuple[str, int]]) -> None:
        now = self._clock()
        # Insertion order is expiry order (one TTL for all), so stop at the first live entry.
        while self._items:
            handle, item = next(iter(self._items.items()))
            if item[0] > now:
                break
            self._drop(handle, gone)

    def _drop(self, handle: str, gone: list[tuple[str, int]]) -> None:
        """Under the lock: the entry forgotten, its file added to `gone` (retired by the
        caller after the lock, `_retire`)."""
        item = self._items.pop(handle)
        self._forget(item)
        self._dropped += 1
        if item[2]:
            gone.append((item[2], item[3]))

    def _forget(self, item: tuple) -> None:
        self._bytes -= item[3]
        if item[2]:
            self._file_bytes -= item[3]


def _read(item: tuple) -> bytes | None:
    if item[2] is None:
        return item[1]
    try:
        with open(item[2], "rb") as f:
            return f.read()
    except OSError:              # removed behind the server's back
        return None


def _unlink_all(ref: weakref.ref) -> None:
    store = ref()
    if store is not None:
        with store._lock:
            paths = [item[2] for item in store._items.values() if item[2]] + [p for _, p in store._free]
        for p in paths:
            remove_quietly(p)


def _sweep_expired(directory: str) -> None:
    """Remove result files past the deadline in their names: a crashed server's (it skips
    `atexit`). By the name's deadline, not by whether their server runs: servers in
    containers sharing /dev/shm (`--ipc=host`) do not see each other's pids, and may have
    TTLs of their own."""
    now = time.time()
    for name in (n for n in list_quietly(directory) if n.startswith(LOCAL_PREFIX)):
        deadline = name[len(LOCAL_PREFIX):].split("-", 1)[0]
        if deadline.isdigit() and int(deadline) < now:
            remove_quietly(os.path.join(directory, name))
