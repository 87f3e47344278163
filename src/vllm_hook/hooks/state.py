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
    """`trees` with every device tensor copied to host memory: one copy per dtype (the
    tensors of a dtype are concatenated on the device first), queued without waiting.
    Returns (new trees, an event to wait on before reading them, or None)."""
    dev = [t for t in tensors_of(trees) if t.device.type != "cpu"]
    if not dev:
        return trees, None
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in dev:
        by_dtype.setdefault(t.dtype, []).append(t)
    host: dict[int, torch.Tensor] = {}
    for dtype, ts in by_dtype.items():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        buf = torch.empty(flat.shape, dtype=dtype, pin_memory=True)
        buf.copy_(flat, non_blocking=True)
        at = 0
        for t in ts:
            host[id(t)] = buf[at:at + t.numel()].view(t.shape)
            at += t.numel()
    event = torch.cuda.Event()
    event.record()
    return _replace(trees, host), event


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
    """(one flat tensor per dtype, named `{prefix}.{dtype}`; the JSON structure of `trees`,
    each tensor as [entry, offset, shape]). A hook that saves a small tensor per step saves
    thousands per request: packed, they cost a few entries to write, send and read."""
    parts: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}

    def enc(v: Any, path: str) -> Any:
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(np.ascontiguousarray(v))
        if isinstance(v, torch.Tensor):
            t = v.detach()
            name = f"{prefix}.{str(t.dtype).removeprefix('torch.')}"
            at = sizes.get(name, 0)
            parts.setdefault(name, []).append(t.reshape(-1))
            sizes[name] = at + t.numel()
            return {"t": [name, at, list(t.shape)]}
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
    tensors = {name: torch.cat([p.cpu() for p in ps]) if len(ps) > 1 else ps[0].cpu().contiguous()
               for name, ps in parts.items()}
    return tensors, structure


def decode(structure: list, tensors: dict[str, torch.Tensor]) -> list:
    def dec(v: dict) -> Any:
        if "t" in v:
            name, at, shape = v["t"]
            n = math.prod(shape)
            return tensors[name][at:at + n].view(shape)
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
