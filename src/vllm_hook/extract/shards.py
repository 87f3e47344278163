"""Rows of finished records into safetensors shards, written in the background.

A shard closes after the record that brings it to `shard_rows` rows or more, so shard
boundaries fall between records and depend only on the input: a resumed run (which starts
at the manifest's `records_done`, a boundary) writes the same shards as an uninterrupted one.
At most one shard is being written while the next fills: memory stays bounded by about two
shards whatever the dataset's size.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from .job import Failure, Manifest, Shard


# safetensors creates files 0600; a dataset is meant to be read by others, like the manifest.
FILE_MODE = 0o644


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


class ShardWriter:
    def __init__(self, out_dir: Path, manifest: Manifest):
        self.out, self.manifest = Path(out_dir), manifest
        self._buf: list[dict[str, torch.Tensor]] = []
        self._rows = 0
        self._done = manifest.records_done      # inputs before it are in written shards
        self._failures: list[Failure] = []      # not yet in a written manifest
        self._tokens = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-hook-extract")
        self._pending: Future | None = None

    def add(self, record: int, rows: dict[str, torch.Tensor], tokens: int) -> None:
        """The rows of one finished record (input index `record`), in input order."""
        self._buf.append(rows)
        self._rows += len(rows["position"])
        self._tokens += tokens
        if self._rows >= self.manifest.job.shard_rows:
            self._flush(record + 1)

    def fail(self, failure: Failure) -> None:
        self._failures.append(failure)

    def finish(self, records_total: int) -> None:
        """Write what is left and mark the dataset complete."""
        self._flush(records_total, complete=True)
        self.close()

    def stop(self, records_done: int | None = None) -> None:
        """Write what is buffered (when `records_done` is given: every input before it was
        handled) and wait for the writes; the dataset stays incomplete, to be resumed."""
        if records_done is not None:
            self._flush(records_done)
        self.close()

    def close(self) -> None:
        self._wait()
        self._pool.shutdown(wait=True)

    def _flush(self, records_done: int, complete: bool = False) -> None:
        tensors = None
        if self._buf:
            tensors = {k: torch.cat([b[k] for b in self._buf]) for k in self._buf[0]}
        first, self._done = self._done, records_done
        failures = [f for f in self._failures if f.record < records_done]
        self._failures = [f for f in self._failures if f.record >= records_done]
        tokens, self._tokens = self._tokens, 0
        self._buf, self._rows = [], 0
        self._wait()
        self._pending = self._pool.submit(self._write, tensors, (first, records_done), failures,
                                          tokens, complete)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()        # a failed write (disk full) raises here, in the job

    def _write(self, tensors, records, failures, tokens, complete) -> None:
        m = self.manifest
        if tensors is not None:
            name = shard_name(len(m.shards))
            tmp = self.out / (name + ".tmp")
            save_file(tensors, str(tmp), metadata={"records": f"{records[0]},{records[1]}"})
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, self.out / name)
            m.shards.append(Shard(file=name, rows=len(tensors["position"]), records=records))
            if not m.columns:
                m.columns = {k: [str(t.dtype).removeprefix("torch."), list(t.shape[1:])]
                             for k, t in tensors.items()}
        m.records_done = records[1]
        m.failures.extend(failures)
        m.tokens_processed += tokens
        m.complete = complete
        m.save(self.out)


def discard_unlisted(out_dir: Path, manifest: Manifest) -> None:
    """Remove shard files a killed run wrote after its last manifest (they are redone)."""
    listed = {s.file for s in manifest.shards}
    for p in Path(out_dir).glob("shard-*.safetensors*"):
        if p.name not in listed:
            p.unlink()
