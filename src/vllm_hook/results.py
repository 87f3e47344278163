"""The public results object, built in the frontend from what workers captured.

`activations[site][layer]` is a float32 CPU tensor [rows, hidden], rows in token order (prompt
then generated). vLLM never runs the last sampled token through the model, so a request with
P prompt and G generated tokens has at most P + G - 1 rows. Rows vLLM may compute beyond that
(a surplus step) are dropped here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file
from safetensors.torch import save as st_save

from . import __version__
from .delivery.store import _metadata as _st_metadata
from .delivery.store import points_from_bytes
from .model.layout import PointTable
from .spec.errors import HookRuntimeError
from .spec.resolve import selected_mask

ATTR = "vllm_hook"


@dataclass
class Results:
    request_id: str
    prompt_len: int
    token_ids: list[int]
    activations: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    positions: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    index: int = 0
    model: str = ""
    path: str | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_for_errors(self) -> "Results":
        if self.errors:
            raise HookRuntimeError(f"request {self.request_id}: " + "; ".join(self.errors))
        return self

    def _payload(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors = {"token_ids": torch.tensor(self.token_ids, dtype=torch.int64)}
        for site, per_layer in self.activations.items():
            for layer, t in per_layer.items():
                tensors[f"{site}.{layer}"] = t.contiguous()
                tensors[f"{site}.{layer}.positions"] = self.positions[site][layer].contiguous()
        meta = {
            "vllm_hook_version": __version__,
            "model": self.model,
            "request_id": self.request_id,
            "index": str(self.index),
            "prompt_len": str(self.prompt_len),
            "sites": json.dumps({s: sorted(v) for s, v in self.activations.items()}),
            "errors": json.dumps(self.errors),
        }
        return tensors, meta

    def save(self, path: str | os.PathLike) -> str:
        """One safetensors file: `{site}.{layer}`, `{site}.{layer}.positions`, `token_ids`."""
        tensors, meta = self._payload()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)
        self.path = str(path)
        return self.path

    def to_bytes(self) -> bytes:
        """The bytes of the file `save` writes (what served mode sends to clients)."""
        tensors, meta = self._payload()
        return st_save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, blob: bytes) -> "Results":
        """Inverse of `to_bytes`."""
        return cls._from(st_load(blob), _st_metadata(blob), None)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Results":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return cls._from(load_file(str(path)), meta, str(path))

    @classmethod
    def _from(cls, tensors: dict[str, torch.Tensor], meta: dict, path: str | None) -> "Results":
        out = cls(request_id=meta.get("request_id", ""), prompt_len=int(meta.get("prompt_len", 0)),
                  token_ids=tensors.pop("token_ids").tolist(), index=int(meta.get("index", 0)),
                  model=meta.get("model", ""), errors=json.loads(meta.get("errors", "[]")),
                  path=path)
        for name, t in tensors.items():
            if name.endswith(".positions"):
                continue
            site, layer = name.rsplit(".", 1)
            out.activations.setdefault(site, {})[int(layer)] = t
            out.positions.setdefault(site, {})[int(layer)] = tensors[f"{name}.positions"]
        return out


def build(blob: bytes | None, items: list[dict], points: PointTable, *, request_id: str,
          prompt_token_ids: list[int], output_token_ids: list[int], index: int = 0,
          model: str = "", extra_errors: list[str] | None = None) -> Results:
    """Assemble a request's results from the worker's per-point rows and the spec's items."""
    pts, meta = points_from_bytes(blob) if blob else ({}, {})
    P = len(prompt_token_ids)
    limit = P + max(len(output_token_ids), 1) - 1
    res = Results(request_id=request_id, prompt_len=P, index=index, model=model,
                  token_ids=list(prompt_token_ids) + list(output_token_ids),
                  errors=list(meta.get("errors", [])) + list(extra_errors or []))
    groups: dict[tuple[str, int], list[tuple[str, list[int]]]] = {}
    for it in items:
        groups.setdefault((it["site"], it["layer"]), []).append((it["sel"], it["pos"]))
    for (site, layer), sels in groups.items():
        pos, rows = pts.get(points.col(site, layer), (torch.zeros(0, dtype=torch.int64), None))
        pos_np = pos.numpy()
        keep = pos_np < limit
        pos_np = pos_np[keep]
        mask = np.zeros(pos_np.shape, dtype=bool)
        want = np.zeros(limit, dtype=bool)
        for sel, plist in sels:
            if sel == "last":
                mask |= pos_np == (limit - 1)
                want[limit - 1] = True
            else:
                mask |= selected_mask(sel, plist, pos_np, P)
                want |= selected_mask(sel, plist, np.arange(limit), P)
        if rows is None:
            t = torch.zeros(0, 0)
        else:
            t = rows[torch.from_numpy(keep)][torch.from_numpy(mask)].float()
        got = pos_np[mask]
        res.activations.setdefault(site, {})[layer] = t
        res.positions.setdefault(site, {})[layer] = torch.from_numpy(got.astype(np.int64))
        missing = np.setdiff1d(np.nonzero(want)[0], got)
        if len(missing):
            res.errors.append(f"{site} layer {layer}: {len(missing)} selected rows were not "
                              f"captured (positions {missing[:8].tolist()}...)")
    return res


def results(output: Any, *, strict: bool = True) -> Results | list[Results]:
    """The vllm_hook results of a `RequestOutput` (a list of them when the request had n > 1).

    With strict=True (default) a request whose capture or steering failed raises
    HookRuntimeError; with strict=False inspect `.errors` yourself."""
    r = getattr(output, ATTR, None)
    if r is None:
        raise LookupError("this output carries no vllm_hook results: the request had no "
                          "vllm_hook spec, or the plugin is disabled (VLLM_HOOK_DISABLE)")
    if strict:
        for x in r if isinstance(r, list) else [r]:
            x.raise_for_errors()
    return r
