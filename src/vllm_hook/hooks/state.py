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


class CallLog:
    """The `ctx.save(key, t)` calls of one batched hook while its group keeps the same
    requests in the same order (steady decode): each call's tensor and every request's
    (first row, rows), appended once per call, not once per request. Each request's RowLog
    holds a run of it (`RowLog.pieces`: (CallLog, member, first call)); a CallLog takes no
    calls once its group changes, so a run ends where the next piece of its RowLog begins."""

    __slots__ = ("calls", "sig", "since", "_counted", "_rows", "_stacked")

    def __init__(self, sig: tuple, members: int):
        self.calls: list[tuple[torch.Tensor, list[tuple[int, int]]]] = []
        self.sig = sig
        self.since = 0                # calls[since:] have the same segments (steady decode)
        self._counted, self._rows = 0, np.zeros(members, dtype=np.int64)
        self._stacked: tuple[int, int, torch.Tensor] | None = None

    def append(self, t: torch.Tensor, segs: list[tuple[int, int]]) -> None:
        if self.calls:
            last = self.calls[-1][1]
            if segs is not last and segs != last:
                self.since = len(self.calls)
        self.calls.append((t, segs))

    def rows(self, j: int) -> int:
        """Rows member j's calls have saved so far (counted once per call, when asked)."""
        run, times = None, 0           # steady decode: one segments list, call after call
        for _, segs in self.calls[self._counted:]:
            if segs is not run:
                if times:
                    self._rows += times * np.fromiter((n for _, n in run), dtype=np.int64, count=len(run))
                run, times = segs, 0
            times += 1
        if times:
            self._rows += times * np.fromiter((n for _, n in run), dtype=np.int64, count=len(run))
        self._counted = len(self.calls)
        return int(self._rows[j])

    def blocks(self, j: int, first: int) -> list[tuple[torch.Tensor, list[int]]]:
        """Member j's rows of calls[first:] as (tensor, rows of each call in it): the calls of
        the trailing run with the same segments as one block, sliced from one stack of those
        calls that every member shares (a batch's requests finish together); the earlier
        calls one slice each."""
        n_calls, since = len(self.calls), max(first, self.since)
        out = [(t[a:a + n], [n]) for t, segs in self.calls[first:since] for a, n in (segs[j],)]
        if n_calls - since == 1:
            t, segs = self.calls[since]
            a, n = segs[j]
            out.append((t[a:a + n], [n]))
        elif n_calls > since:
            st = self._stacked
            if st is None or st[:2] != (since, n_calls):
                st = self._stacked = (since, n_calls, torch.stack([t for t, _ in self.calls[since:]]))
            a, n = self.calls[since][1][j]
            part = st[2][:, a:a + n]
            out.append((part.reshape(-1, *part.shape[2:]), [n] * (n_calls - since)))
        return out


class RowLog:
    """What `ctx.save(key, t)` appends to: each call's rows of this request as pieces
    (tensor, first row, rows) of a tensor the call's requests share (a batched hook's output),
    or runs of a CallLog (a batched hook in steady decode). Nothing is sliced per request on
    the step path; the pieces are copied to the host in one concatenation with the rest of
    the request's tensors, travel as one tensor with the row count of each call, and arrive
    as a list of one tensor per call."""

    __slots__ = ("pieces", "sig")

    def __init__(self, sig: tuple):
        self.pieces: list[tuple] = []
        self.sig = sig                  # (dtype, row shape, device, bytes per row): one per key

    @property
    def nbytes(self) -> int:
        rows = 0
        for p in self.pieces:
            if p[0].__class__ is CallLog:
                log, j, first, before = p
                rows += log.rows(j) - before
            else:
                rows += p[2]
        return self.sig[3] * rows

    def blocks(self) -> list[tuple[torch.Tensor, list[int]]]:
        """The rows as (tensor, rows of each call in it): fewer tensors than `views`."""
        out = []
        for p in self.pieces:
            if p[0].__class__ is CallLog:
                out.extend(p[0].blocks(p[1], p[2]))
            else:
                t, a, n = p
                out.append((t[a:a + n], [n]))
        return out

    def views(self) -> list[torch.Tensor]:
        return [v for p in self.pieces for v in _piece_views(p)]

    def __len__(self) -> int:
        return sum(len(p[0].calls) - p[2] if p[0].__class__ is CallLog else 1 for p in self.pieces)

    def __getitem__(self, i):
        return self.views()[i]

    def __iter__(self):
        return iter(self.views())


def _piece_views(p: tuple) -> list[torch.Tensor]:
    if p[0].__class__ is CallLog:
        log, j, first, _ = p
        return [t[a:a + n] for t, segs in log.calls[first:] for a, n in (segs[j],)]
    t, a, n = p
    return [t[a:a + n]]


class CtxList(list):
    """The contexts of a batched hook's group in one step. `epochs` and `key` (set by the
    worker) find the group's CallLogs: while the same requests come in the same order, the
    calls of every step go to the same CallLogs."""

    __slots__ = ("epochs", "key", "epoch")

    def __init__(self, items=(), epochs: dict | None = None, key=None):
        super().__init__(items)
        self.epochs, self.key, self.epoch = epochs, key, None

    def logs(self) -> dict | None:
        """{save key: CallLog} of this group's current epoch (None: no epochs here)."""
        if self.epoch is None and self.epochs is not None:
            ep = self.epochs.get(self.key)
            # The same context objects (held by the epoch, so no new request reuses an id),
            # in the same order.
            if ep is None or len(ep[0]) != len(self) or any(a is not b for a, b in zip(ep[0], self)):
                ep = self.epochs[self.key] = (tuple(self), {})
            self.epoch = ep[1]
        return self.epoch


class Rows:
    """A RowLog on the host: one tensor (the calls' rows in order) and each call's row count."""

    __slots__ = ("data", "counts")

    def __init__(self, data: torch.Tensor, counts: list[int]):
        self.data, self.counts = data, counts


_SIGS: dict[tuple, tuple] = {}      # interned: a RowLog's signature is checked by identity


def _signature(key: str, t) -> tuple[torch.Tensor, tuple]:
    if not isinstance(t, torch.Tensor):
        raise StateError(f"ctx.save({key!r}, ...) takes a tensor, got {type(t).__name__}")
    t = t.detach()
    if not t.dim():
        t = t[None]
    raw = (t.dtype, tuple(t.shape[1:]), t.device, t.element_size() * (t.numel() // max(t.shape[0], 1)))
    sig = _SIGS.get(raw)
    if sig is None:
        if len(_SIGS) > 4096:
            _SIGS.clear()
        sig = _SIGS[raw] = raw
    return t, sig


def _log_of(d: dict, key: str, sig: tuple) -> RowLog:
    log = d.get(key)
    if log is None:
        log = d[key] = RowLog(sig)
    elif log.__class__ is not RowLog or log.sig is not sig:
        _refuse(key, log, sig)
        log.sig = sig          # a signature equal to an interned one cleared since
    return log


# Set while a CUDA graph of a step's hooks is captured (`worker/hook_graphs.py`): the saves
# are recorded, not made, and made again after every replay on copies of the graph's outputs.
RECORDING: list | None = None


def append_rows(key: str, t: torch.Tensor, saved: list[dict], segs) -> None:
    """Append piece (first row, rows) of `t` to the RowLog `key` of each dict in `saved`
    (`segs[i]` for `saved[i]`; a None count means all of `t`'s rows)."""
    t, sig = _signature(key, t)
    if RECORDING is not None:
        RECORDING.append((append_rows, key, t, saved, segs))
        return
    for d, (a, n) in zip(saved, segs):
        _log_of(d, key, sig).pieces.append((t, a, n))


def append_call(key: str, t: torch.Tensor, ctxs: CtxList, segs: list[tuple[int, int]]) -> None:
    """A batched call's save: one append to the group's CallLog for `key` (a new CallLog, and
    a run of it in every request's RowLog, when the group or the signature changed)."""
    t, sig = _signature(key, t)
    if RECORDING is not None:
        RECORDING.append((append_call, key, t, ctxs, segs))
        return
    logs = ctxs.logs()
    log = logs.get(key)
    if log is None or log.sig is not sig:
        log = CallLog(sig, len(ctxs))
        runs = [_log_of(c.saved, key, sig) for c in ctxs]     # every check before any change
        for j, rl in enumerate(runs):
            rl.pieces.append((log, j, 0, 0))
        logs[key] = log
    log.append(t, segs)


def _refuse(key: str, log, sig: tuple) -> None:
    if not isinstance(log, RowLog):
        raise StateError(f"saved[{key!r}] holds a {type(log).__name__}: ctx.save keeps its own "
                         "keys; use another key for values set by hand")
    if log.sig != sig:
        raise StateError(f"ctx.save({key!r}, ...) got {sig[0]} rows of shape {list(sig[1])} after "
                         f"{log.sig[0]} rows of shape {list(log.sig[1])}: one key keeps one dtype "
                         "and row shape")


def leaves(tree: Any, out: list | None = None, depth: int = 0) -> list:
    """Every tensor and RowLog in `tree`."""
    out = [] if out is None else out
    if depth > 64:
        raise StateError("saved values nested more than 64 levels deep")
    if isinstance(tree, (torch.Tensor, RowLog)):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            leaves(v, out, depth + 1)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            leaves(v, out, depth + 1)
    return out


def nbytes(tree: Any) -> int:
    return sum(x.nbytes if isinstance(x, RowLog) else x.numel() * x.element_size() for x in leaves(tree))


def _device(x) -> str:
    return x.sig[2].type if isinstance(x, RowLog) else x.device.type


def to_host(trees: list) -> tuple[list, Any]:
    """`trees` with every device tensor (and RowLog) copied to host memory, queued without
    waiting: the rows of one dtype and row shape are concatenated on the device (one call,
    however many steps saved one each) and copied as one. Returns (new trees, an event to wait
    on before reading them, or None)."""
    dev = [x for x in leaves(trees) if _device(x) != "cpu"]
    if not dev:
        return trees, None
    groups: dict[tuple, list] = {}
    for x in dev:
        blocks = x.blocks() if isinstance(x, RowLog) else [(x.detach() if x.dim() else x.detach()[None], None)]
        groups.setdefault((blocks[0][0].dtype, tuple(blocks[0][0].shape[1:])), []).append((x, blocks))
    host: dict[int, Any] = {}
    on_gpu = False
    for items in groups.values():
        flat = torch.cat([b for _, blocks in items for b, _ in blocks])
        on_gpu |= flat.is_cuda
        buf = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.is_cuda)
        buf.copy_(flat, non_blocking=True)
        at = 0
        for x, blocks in items:
            rows = sum(b.shape[0] for b, _ in blocks)
            part = buf[at:at + rows]
            at += rows
            host[id(x)] = (Rows(part, [n for _, c in blocks for n in c]) if isinstance(x, RowLog)
                           else part.view(x.shape))
    event = None
    if on_gpu:
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


def _replace(tree: Any, host: dict[int, Any]) -> Any:
    if isinstance(tree, (torch.Tensor, RowLog)):
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
        if isinstance(v, RowLog):            # CPU engines: never copied, so never a Rows
            blocks = v.blocks()
            v = Rows(torch.cat([b for b, _ in blocks]), [n for _, c in blocks for n in c])
        if isinstance(v, Rows):
            found.append(v.data)
            return {"t": len(found) - 1, "c": v.counts}
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
            return {"t": where[id(found[v["t"]])], **({"c": v["c"]} if "c" in v else {})}
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
            if "c" in v:                     # a RowLog: one tensor per call
                return list(part.reshape(shape).split(v["c"]))
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


def merge_stages(stages: list[list[dict]], numbers: list[int] | None = None) -> list[dict]:
    """Each hook's `saved` from every pipeline stage (stage order; each stage runs the hook at
    its own layers) as one dict per hook: a key saved on one stage as it is; lists (what
    `ctx.save` makes) saved under one key on several stages joined in stage order, dicts merged
    key by key alike; any other value saved under one key on a later stage too comes back as
    `"{key}@stage{s}"` (s: the stage's number in `numbers`, else its index), nothing dropped."""
    if len(stages) == 1:
        return stages[0]
    n = max(len(s) for s in stages)
    merged: list[dict] = [{} for _ in range(n)]
    for stage, saved in zip(numbers or range(len(stages)), stages):
        for out, d in zip(merged, saved):
            _merge_into(out, d, stage)
    return merged


def _merge_into(out: dict, d: dict, stage: int) -> None:
    for k, v in d.items():
        if k not in out:
            out[k] = v
        elif isinstance(out[k], list) and isinstance(v, list):
            out[k] = out[k] + v
        elif isinstance(out[k], dict) and isinstance(v, dict):
            out[k] = dict(out[k])
            _merge_into(out[k], v, stage)
        else:
            out[f"{k}@stage{stage}"] = v
