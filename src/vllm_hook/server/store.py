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
and results' files take at most a quarter of their file system (`spill.keep_limit`: other
programs' shared memory must not find it full), files kept for reuse (below) at most a
quarter of that more. Where a file cannot be written (no such directory, no
room, `local_results` off) the bytes stay in memory and the entry has no path: the client
fetches it as before. HTTP fetches of a file-backed entry read the file.

A file whose client is done with it (released, deleted, or fetched over HTTP by `pop`) is
kept for a later result instead of deleted, up to `FREE_KEEP_BYTES` (or a quarter of the
files' bound where that is less) on top of that bound: renamed to a name no entry holds, it
keeps its pages, and a later result as large or up to half as large claims it by renaming it
to that result's name and writes into those pages, where a new file's pages are each
allocated and zeroed by the kernel first (3.1 MB: about 4 ms of the writer's CPU on the CI
machine, most of a served every-token result's cost there). Never kept: a file whose entry
expired or was evicted, or that a fetch of the server is reading, whose reader may not be
done: it is deleted (the reader keeps what it opened). A claimed file is written only if it
is still the one kept (a regular file of this user's, one link, the same inode).
"""

from __future__ import annotations

import os
import secrets
import stat
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
        self._free: list[tuple[int, str, int, int]] = []   # kept for reuse: (size, path, dev, inode)
        self._reading: dict[str, int] = {}                  # paths a fetch is reading: how many
        self._free_bytes = 0
        self._free_limit = 0
        self._lock = threading.Lock()  # puts may come from encoding threads
        local_dir = os.path.abspath(local_dir) if local_dir else None
        self.local_dir = local_dir if local_dir and os.access(local_dir, os.W_OK) else None
        if self.local_dir is not None:
            self._file_limit = keep_limit(self.local_dir)
            self._free_limit = min(FREE_KEEP_BYTES, self._file_limit // 4)
            _sweep_expired(self.local_dir)
            # Files left behind would hold shared memory until the host reboots: removed when
            # the store goes, or at exit (a finalizer holds the store's containers, not it)
            self._finalizer = weakref.finalize(self, _remove_files, self._items, self._free, self._lock)

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
        gone: list[str] = []
        with self._lock:
            self._expire(gone)
            while self._items and self._bytes + len(data) > self.max_bytes:
                self._drop(next(iter(self._items)), gone)
            self._items[handle] = (self._clock() + self.ttl_s, None if path else data, path, len(data))
            self._bytes += len(data)
        _remove_each(gone)
        return handle

    def _write(self, data: bytes | StParts) -> str | None:
        """`data` in a file of its own (one kept for reuse where one is large enough, else a
        new one), or None (no room: in memory instead)."""
        with self._lock:
            if self._clock() < self._full_until or self._file_bytes + len(data) > self._file_limit:
                return None
            self._file_bytes += len(data)           # reserved; given back below if unwritten
            claim = min((f for f in self._free if len(data) <= f[0] <= 2 * len(data)), default=None)
            if claim is not None:
                self._free.remove(claim)
                self._free_bytes -= claim[0]
        path = os.path.join(self.local_dir, self._name())
        fd = None
        try:
            if claim is not None:
                fd = _claimed(claim, path)
            if fd is None:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            if claim is not None:
                os.ftruncate(fd, len(data))
            if isinstance(data, StParts):
                data.write(fd)
            else:
                view = memoryview(data)
                while len(view):
                    view = view[os.write(fd, view):]
        except BaseException as e:
            if fd is not None:          # (a file this store made or claimed under this name)
                remove_quietly(path)
            with self._lock:
                self._file_bytes -= len(data)
                if isinstance(e, OSError):     # full (a container's 64 MB /dev/shm): memory for a while
                    self._full_until = self._clock() + FULL_BACKOFF_S
            if isinstance(e, OSError):
                return None
            raise
        finally:
            if fd is not None:
                os.close(fd)
        return path

    def _name(self) -> str:
        """A file name of this store's: its deadline and a random token (no handle)."""
        return f"{LOCAL_PREFIX}{int(time.time() + self.ttl_s) + 1}-{secrets.token_urlsafe(12)}"

    def path(self, handle: str) -> str | None:
        """The file holding the entry `handle`, if it is kept as one."""
        with self._lock:
            item = self._items.get(handle)
        return item[2] if item else None

    def get(self, handle: str) -> bytes | None:
        gone: list[str] = []
        with self._lock:
            self._expire(gone)
            item = self._items.get(handle)
            if item and item[2]:             # not kept for reuse while read (`_retire`)
                self._reading[item[2]] = self._reading.get(item[2], 0) + 1
        _remove_each(gone)
        try:
            data = _read(item) if item else None
        finally:
            if item and item[2]:
                with self._lock:
                    left = self._reading.pop(item[2]) - 1
                    if left:
                        self._reading[item[2]] = left
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
            self._retire(item[2], item[3])
        return data

    def delete(self, handle: str) -> bool:
        """The entry removed (its client is done with it: its file may be kept for reuse)."""
        item = self._take(handle)
        if item and item[2]:
            self._retire(item[2], item[3])
        return item is not None

    def _take(self, handle: str) -> tuple | None:
        gone: list[str] = []
        with self._lock:
            self._expire(gone)
            item = self._items.pop(handle, None)
            if item:
                self._forget(item)
        _remove_each(gone)
        return item

    def _retire(self, path: str, size: int) -> None:
        """The file of an entry its client is done with: kept for reuse within the bound and
        unless a fetch is reading it (under a name no entry holds), else deleted. Not under
        the lock: a rename, and freeing a large file's pages, take a while."""
        with self._lock:
            keep = (path not in self._reading and self._free_bytes + size <= self._free_limit
                    and len(self._free) < FREE_KEEP_FILES)
            if keep:
                self._free_bytes += size                   # reserved
        if keep:
            free = os.path.join(os.path.dirname(path), self._name())
            try:
                os.rename(path, free)
                st = os.stat(free, follow_symlinks=False)
            except OSError:                                 # removed behind the server's back
                keep = False
            with self._lock:
                if keep:
                    self._free.append((size, free, st.st_dev, st.st_ino))
                else:
                    self._free_bytes -= size
        if not keep:
            remove_quietly(path)

    def stats(self) -> StoreStats:
        gone: list[str] = []
        with self._lock:
            self._expire(gone)
            out = StoreStats(len(self._items), self._bytes, self.max_bytes, self.ttl_s, self._dropped,
                             sum(1 for item in self._items.values() if item[2]))
        _remove_each(gone)
        return out

    def _expire(self, gone: list[str]) -> None:
        now = self._clock()
        # Insertion order is expiry order (one TTL for all), so stop at the first live entry.
        while self._items:
            handle, item = next(iter(self._items.items()))
            if item[0] > now:
                break
            self._drop(handle, gone)

    def _drop(self, handle: str, gone: list[str]) -> None:
        """Under the lock: the entry forgotten, its file's path added to `gone` (deleted by
        the caller after the lock, never kept: its reader may not be done)."""
        item = self._items.pop(handle)
        self._forget(item)
        self._dropped += 1
        if item[2]:
            gone.append(item[2])

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


def _claimed(kept: tuple[int, str, int, int], path: str) -> int | None:
    """A kept file (size, path, dev, inode) renamed to `path` and opened for writing, or None
    (it vanished, or what is there now is not it: left alone)."""
    try:
        os.rename(kept[1], path)
    except OSError:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
            and (st.st_dev, st.st_ino) == kept[2:]):
        return fd
    os.close(fd)
    return None


def _remove_each(paths: list[str]) -> None:
    for p in paths:
        remove_quietly(p)


def _remove_files(items: dict, free: list, lock: threading.Lock) -> None:
    """A store's files: its entries' and those kept for reuse."""
    with lock:
        paths = [item[2] for item in items.values() if item[2]] + [f[1] for f in free]
    _remove_each(paths)


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
