"""Allocation of op and vector rows in the device tables, with reference counts.

Rows are written once, when a request is admitted, and released when it finishes. Writes are
stream-ordered after earlier forwards, so reusing a released row never changes a step that
is already queued. They are queued, not made at admission: `flush` uploads them right before
the step's routing, on a GPU from pinned memory without waiting (a copy from ordinary memory
would wait for the GPU to finish every queued step first).
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from ..delivery.hostmem import upload
from ..model.buffers import HookBuffers


class TableFull(RuntimeError):
    pass


class DeviceTables:
    def __init__(self, bufs: HookBuffers):
        self.bufs = bufs
        s = bufs.shape
        self._free_ops = list(range(s.max_ops, 0, -1))
        self._free_vecs = list(range(s.max_vectors, 0, -1))
        self._vec_rows: dict[str, int] = {}     # digest -> row
        self._vec_refs: dict[int, int] = {}     # row -> references
        self._vec_digest: dict[int, str] = {}
        self.units: dict[int, np.ndarray] = {}   # row -> unit vector (host copy, for u.u)
        self.norms: dict[int, float] = {}
        # Queued writes: (rows, their values as one 2-D array), one entry per admission
        self._ops: list[tuple[list[int], np.ndarray]] = []
        self._vecs: list[tuple[list[int], np.ndarray]] = []
        # A row released while writes are queued may be queued twice (released, then acquired
        # again before the flush): only then does the flush look for rows written twice.
        self._reused = False

    def acquire_vector(self, digest: str, values: np.ndarray, refs: int = 1) -> int:
        """The row of the vector `digest` (written from `values` when new), `refs` references
        more (released by `release_vector`)."""
        row = self._vec_rows.get(digest)
        if row is None:
            if not self._free_vecs:
                raise TableFull(
                    f"more than {self.bufs.shape.max_vectors} distinct steering vectors are in use "
                    "at once; raise additional_config vllm_hook.max_vectors")
            row = self._free_vecs.pop()
            v = np.asarray(values, dtype=np.float64)
            norm = float(np.linalg.norm(v))
            u = (v / norm if norm > 0 else v).astype(np.float32)
            self._vecs.append(([row], u[None]))
            self.units[row], self.norms[row] = u, norm
            self._vec_rows[digest] = row
            self._vec_digest[row] = digest
            self._vec_refs[row] = 0
        self._vec_refs[row] += refs
        return row

    def row_of(self, digest: str) -> int | None:
        """The row holding vector `digest`, if one does."""
        return self._vec_rows.get(digest)

    def release_vector(self, row: int, refs: int = 1) -> None:
        self._vec_refs[row] -= refs
        if self._vec_refs[row] == 0:
            del self._vec_refs[row]
            del self._vec_rows[self._vec_digest.pop(row)]
            del self.units[row], self.norms[row]
            self._reused |= bool(self._vecs)
            self._free_vecs.append(row)

    def acquire_ops(self, params: np.ndarray) -> list[int]:
        """Rows for the ops whose parameters are the rows of `params` (n, 4 + K)."""
        n = len(params)
        if n == 0:
            return []
        if n > len(self._free_ops):
            raise TableFull("the steering op table is full; too many steered requests are "
                            "preempted at once. Lower max_num_seqs or steer fewer layers")
        rows = self._free_ops[-n:][::-1]
        del self._free_ops[len(self._free_ops) - n:]
        self._ops.append((rows, params))
        return rows

    def flush(self) -> None:
        """Write (on a GPU: queue the uploads of) the rows acquired since the last flush."""
        reused, self._reused = self._reused, False
        for queued, table in ((self._ops, self.bufs.op_prm), (self._vecs, self.bufs.unit)):
            if not queued:
                continue
            # (one pass in C: a prefill step of 128 new specs of 28 ops flushed in 430 µs on
            # the CI machine with a list through torch.tensor and a dict of rows, 130 so)
            n = sum(len(r) for r, _ in queued)
            rows = np.fromiter(chain.from_iterable(r for r, _ in queued), dtype=np.int64, count=n)
            values = np.concatenate([v for _, v in queued]).astype(np.float32, copy=False)
            if reused:
                # A row written twice since the last flush: the later write wins (index_copy_
                # with repeated indices does not say which), so only its last write goes.
                _, first_from_end = np.unique(rows[::-1], return_index=True)
                if len(first_from_end) < n:
                    keep = np.sort(n - 1 - first_from_end)
                    rows, values = rows[keep], values[keep]
            table.index_copy_(0, upload(torch.from_numpy(rows), table.device),
                              upload(torch.from_numpy(values), table.device))
            queued.clear()

    def release_ops(self, rows: list[int]) -> None:
        self._reused |= bool(self._ops)
        self._free_ops.extend(rows)

    @property
    def vectors_in_use(self) -> int:
        return len(self._vec_rows)

    @property
    def ops_in_use(self) -> int:
        return self.bufs.shape.max_ops - len(self._free_ops)
