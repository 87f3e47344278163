"""Reading an activation dataset that `vllm-hook extract` wrote.

Layout of a dataset directory: `manifest.json` and `shard-00000.safetensors`, ... Each shard
is a plain safetensors file of equally long columns, one row per captured token:
`prompt_index` (the input's index: JSONL line number - 1, or dataset row), `position` (token
position in its prompt + generation), `token_id`, and `{site}.{layer}` (`[rows, hidden]`;
`[rows, heads, head_dim]` for q and k). Any safetensors reader opens a shard on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .job import Manifest


class ActivationDataset:
    """`len(ds)` rows; `ds["resid_post.12"]` a column over all shards; `ds.shards()` one shard
    at a time (bounded memory); `ds.to_hf()` a `datasets.Dataset`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = Manifest.load(self.path)

    def __len__(self) -> int:
        return self.manifest.rows

    def __repr__(self) -> str:
        m = self.manifest
        state = "complete" if m.complete else f"incomplete: {m.records_done} of {m.records_total} inputs"
        return (f"ActivationDataset({str(self.path)!r}, rows={len(self)}, shards={len(m.shards)}, "
                f"columns={self.columns}, {state})")

    @property
    def columns(self) -> list[str]:
        return list(self.manifest.columns)

    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    @property
    def site(self) -> str:
        return self.manifest.job.site

    def shards(self, columns: list[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        for s in self.manifest.shards:
            if columns is None:
                yield load_file(str(self.path / s.file))
            else:
                with safe_open(str(self.path / s.file), "pt") as f:
                    yield {c: f.get_tensor(c) for c in columns}

    def __getitem__(self, column: str) -> torch.Tensor:
        if column not in self.manifest.columns:
            raise KeyError(f"no column {column!r}; columns: {self.columns}")
        parts = [s[column] for s in self.shards([column])]
        if parts:
            return torch.cat(parts)
        dtype, shape = self.manifest.columns[column]
        return torch.zeros((0, *shape), dtype=getattr(torch, dtype))

    def activations(self, layer: int) -> torch.Tensor:
        return self[f"{self.site}.{layer}"]

    def to_hf(self, cache_dir: str | None = None):
        """A `datasets.Dataset` (Arrow, on disk, built shard by shard; activations as float32
        arrays, since Arrow has no bfloat16)."""
        import datasets

        # Files and their mtimes are arguments: datasets' cache key changes with the shards.
        files = [(str(p), p.stat().st_mtime_ns) for p in (self.path / s.file for s in self.manifest.shards)]
        return datasets.Dataset.from_generator(_hf_rows, gen_kwargs={"files": files}, cache_dir=cache_dir)


def _hf_rows(files: list[tuple[str, int]]):
    for f, _ in files:
        arrays = {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in load_file(f).items()}
        for i in range(len(arrays["position"])):
            yield {k: a[i] for k, a in arrays.items()}


def load_dataset(path: str | Path) -> ActivationDataset:
    """Open a dataset written by `vllm-hook extract` (complete, or interrupted: the shards
    listed in its manifest are whole)."""
    return ActivationDataset(path)
