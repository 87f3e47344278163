"""A hook's `ctx.saved`: moved to host memory in bulk, bounded, and encoded for transport.

`saved` may hold dicts (string keys), lists, tuples, strings, numbers, booleans, None,
torch tensors and numpy arrays, nested. It travels as safetensors: every tensor is one entry,
the structure is JSON (in the file's metadata) with each tensor replaced by its entry name.
Nothing is pickled, so a client can read results from a server without trusting it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


class StateError(TypeError):
    pass


def tensors_of(tree: Any, out: list | None = None, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in `tree` (numpy arrays too, as tensors)."""
    out = [] if out is None else out
    if depth > 64:
        raise StateError("saved values nested more than 64 levels deep")
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            tensors_of(v, out, depth + 1)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            tensors_of(v, out, depth + 1)
    return out


def nbytes(tree: Any) -> int:
    n = sum(t.numel() * t.element_size() for t in tensors_of(tree))
    return n


def to_host(trees: list) -> tuple[list, Any]:
    """`trees` with every device tensor copied to host memory, queued without waiting: the
    tensors of one dtype and row shape are concatenated on the device (one call, however many
    steps saved one each) and copied as one. Returns (new trees, an event to wait on before
    reading them, or None)."""
    dev = [t for t in tensors_of(trees) if t.device.type != "cpu"]
    if not dev:
        return trees, None
    host: dict[int, torch.Tensor] = {}
    for ts in _groups(dev).values():
        flat = torch.cat([t.detach() if t.dim() else t.detach()[None] for t in ts])
        buf = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        buf.copy_(flat, non_blocking=True)
        for t, part in zip(ts, buf.split([t.shape[0] if t.dim() else 1 for t in ts])):
            host[id(t)] = part.view(t.shape)
    event = torch.cuda.Event()
    event.record()
    return _replace(trees, host), event


def _groups(ts: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """Tensors by (dtype, shape past the first dimension): each group concatenates along
    dimension 0 in one call."""
    out: dict[tuple, list[torch.Tensor]] = {}
    for t in ts:
        out.setdefault((t.dtype, tuple(t.shape[1:]) if t.dim() else ("scalar",)), []).append(t)
    return out


def _replace(tree: Any, host: dict[int, torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return host.get(id(tree), tree)
    if isinstance(tree, dict):
        return {k: _replace(v, host) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_replace(v, host) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_replace(v, host) for v in tree)
    return tree


def encode(trees: list, prefix: str) -> tuple[dict[str, torch.Tensor], list]:
    """(one tensor per dtype and row shape, named `{prefix}.{n}`; the JSON structure of
    `trees`, each tensor as [entry, first row, shape]). A hook that saves a small tensor per
    step saves thousands per request: packed, they cost a few entries to write, send, read."""
    found: list[torch.Tensor] = []

    def enc(v: Any, path: str) -> Any:
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(np.ascontiguousarray(v))
        if isinstance(v, torch.Tensor):
            found.append(v.detach())
            return {"t": len(found) - 1}
        if isinstance(v, dict):
            bad = [k for k in v if not isinstance(k, str)]
            if bad:
                raise StateError(f"{path} has a non-string key {bad[0]!r}: use string keys")
            return {"d": {k: enc(x, f"{path}[{k!r}]") for k, x in v.items()}}
        if isinstance(v, (list, tuple)):
            return {"l" if isinstance(v, list) else "u": [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return {"v": v}
        if isinstance(v, (int, np.integer)):
            return {"v": int(v)}
        if isinstance(v, (float, np.floating)):
            f = float(v)
            return {"v": f} if math.isfinite(f) else {"f": repr(f)}
        raise StateError(f"{path} is a {type(v).__name__}: save tensors, numpy arrays, numbers, "
                         "strings, booleans, None, and lists or dicts of them")

    structure = [enc(t, f"saved[{i}]") for i, t in enumerate(trees)]
    tensors, where = {}, {}
    for n, ts in enumerate(_groups(found).values()):
        name = f"{prefix}.{n}"
        rows = [t.reshape(1, *t.shape) if not t.dim() else t for t in ts]
        tensors[name] = torch.cat([r.cpu() for r in rows]) if len(rows) > 1 else rows[0].cpu().contiguous()
        at = 0
        for t, r in zip(ts, rows):
            where[id(t)] = [name, at, list(t.shape)]
            at += r.shape[0]

    def place(v: dict) -> dict:
        if "t" in v:
            return {"t": where[id(found[v["t"]])]}
        if "d" in v:
            return {"d": {k: place(x) for k, x in v["d"].items()}}
        if "l" in v or "u" in v:
            key = "l" if "l" in v else "u"
            return {key: [place(x) for x in v[key]]}
        return v

    return tensors, [place(s) for s in structure]


def decode(structure: list, tensors: dict[str, torch.Tensor]) -> list:
    def dec(v: dict) -> Any:
        if "t" in v:
            name, at, shape = v["t"]
            t = tensors[name]
            rows = shape[0] if shape else 1
            part = t[at:at + rows]
            return part.reshape(shape)
        if "d" in v:
            return {k: dec(x) for k, x in v["d"].items()}
        if "l" in v:
            return [dec(x) for x in v["l"]]
        if "u" in v:
            return tuple(dec(x) for x in v["u"])
        if "f" in v:
            return float(v["f"])
        return v.get("v")

    return [dec(t) for t in structure]


def encode_collected(results: dict[str, list]) -> bytes:
    """Persistent-hook results {request id: [saved of each hook]} as safetensors bytes."""
    import json

    from safetensors.torch import save

    ids = list(results)
    tensors, structure = encode([results[r] for r in ids], "hk")
    return save(tensors, metadata={"vllm_hook": json.dumps({"ids": ids, "hooks": structure})})


def decode_collected(blob: bytes) -> dict[str, list[dict]]:
    """Inverse of `encode_collected` (what `collect_hook_results` returns)."""
    import json

    from safetensors.torch import load

    if not blob:
        return {}
    tensors = load(blob)
    n = int.from_bytes(blob[:8], "little")
    meta = json.loads(json.loads(blob[8:8 + n]).get("__metadata__", {}).get("vllm_hook", "{}"))
    trees = decode(meta.get("hooks", []), tensors)
    return {rid: [dict(t) for t in tree] for rid, tree in zip(meta.get("ids", []), trees)}
