"""Allocation of op and vector rows in the device tables, with reference counts.

Rows are written once, when a request is admitted, and released when it finishes. Writes are
stream-ordered after earlier forwards, so reusing a released row never changes a step that
is already queued. They are queued, not made at admission: `flush` uploads them right before
the step's routing, on a GPU from pinned memory without waiting (a copy from ordinary memory
would wait for the GPU to finish every queued step first).
"""

from __future__ import annotations

from typing import Any

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
        self._ops: list[tuple[int, Any]] = []             # queued writes: row, params (a list or array)
        self._vecs: list[tuple[int, np.ndarray]] = []     # row, unit vector

    def acquire_vector(self, digest: str, values: np.ndarray, refs: int = 1) -> int:
        """The row of the vector `digest` (written from `values` when new), `refs` references
        more (each released by its own `release_vector`)."""
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
            self._vecs.append((row, u))
            self.units[row], self.norms[row] = u, norm
            self._vec_rows[digest] = row
            self._vec_digest[row] = digest
            self._vec_refs[row] = 0
        self._vec_refs[row] += refs
        return row

    def release_vector(self, row: int) -> None:
        self._vec_refs[row] -= 1
        if self._vec_refs[row] == 0:
            del self._vec_refs[row]
            del self._vec_rows[self._vec_digest.pop(row)]
            del self.units[row], self.norms[row]
            self._free_vecs.append(row)

    def acquire_ops(self, params: list[list[float]]) -> list[int]:
        n = len(params)
        if n > len(self._free_ops):
            raise TableFull("the steering op table is full; too many steered requests are "
                            "preempted at once. Lower max_num_seqs or steer fewer layers")
        rows = [self._free_ops.pop() for _ in range(n)]
        self._ops.extend(zip(rows, params))
        return rows

    def flush(self) -> None:
        """Write (on a GPU: queue the uploads of) the rows acquired since the last flush."""
        for queued, table in ((self._ops, self.bufs.op_prm), (self._vecs, self.bufs.unit)):
            if not queued:
                continue
            rows = torch.tensor([r for r, _ in queued], dtype=torch.int64)
            values = torch.tensor(np.asarray([v for _, v in queued], dtype=np.float32))
            # A row written twice since the last flush: the later write wins (index_copy_ with
            # repeated indices does not say which), so only the last write of each row goes.
            last = {r: i for i, (r, _) in enumerate(queued)}
            if len(last) < len(queued):
                keep = torch.tensor(sorted(last.values()), dtype=torch.int64)
                rows, values = rows[keep], values[keep]
            table.index_copy_(0, upload(rows, table.device), upload(values, table.device))
            queued.clear()

    def release_ops(self, rows: list[int]) -> None:
        self._free_ops.extend(rows)

    @property
    def vectors_in_use(self) -> int:
        return len(self._vec_rows)

    @property
    def ops_in_use(self) -> int:
        return self.bufs.shape.max_ops - len(self._free_ops)
