"""The public results object, built in the frontend from what workers captured.

`activations[site][layer]` is a CPU tensor [rows, hidden], float32 (or the model's dtype when
the spec says `"dtype": "model"`), rows in token order (prompt then generated). vLLM never runs
the last sampled token through the model, so a request with P prompt and G generated tokens
has at most P + G - 1 rows. Rows vLLM may compute beyond that
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
from safetensors.torch import load_file

from . import __version__
from .delivery.spill import ST_DTYPES
from .delivery.store import Stacked, StParts, st_bytes, st_tensors
from .delivery.hostmem import CHUNK_BYTES, as_tensor, copy_many, host_empty
from .delivery.store import points_from_bytes
from .model.layout import PointTable
from .spec.errors import HookRuntimeError
from .hooks import state
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
    # For q, k and attn_scores: the global head index of each entry along axis 1.
    heads: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    # hook_results[i]: the ctx.saved of the spec's hook i (CPU tensors, lists, dicts, numbers).
    hook_results: list[dict] = field(default_factory=list)
    # Served: the activations are kept in the dtype the model captured them in and widened to
    # this one ("float32") where they are loaded (`from_bytes`, `load`): exact, and half the
    # bytes to convert, encode and send.
    widen_to: str | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def stacked(self, site: str = "resid_post", layers=None) -> torch.Tensor:
        """One site's captures as one tensor `(n_layers, n_positions, width)` (layers ascending
        unless given; every layer must hold the same positions)."""
        by_layer = self.activations.get(site, {})
        order = sorted(by_layer) if layers is None else [int(L) for L in layers]
        missing = [L for L in order if L not in by_layer]
        if missing or not order:
            raise KeyError(f"no {site} capture at layers {missing or order} (captured: {sorted(by_layer)})")
        first = self.positions[site][order[0]]
        if any(not torch.equal(self.positions[site][L], first) for L in order[1:]):
            raise ValueError(f"{site} layers hold different positions; index activations per layer")
        return torch.stack([as_tensor(by_layer[L]) for L in order])

    @property
    def residual_stream(self) -> torch.Tensor:
        """vllm-lens's view: resid_post of every captured layer, `(n_layers, n_positions, hidden)`."""
        return self.stacked("resid_post")

    def raise_for_errors(self) -> "Results":
        if self.errors:
            raise HookRuntimeError(f"request {self.request_id}: " + "; ".join(self.errors))
        return self

    def _payload(self, stacked: bool = False, tokens: bool = True,
                 lazy: bool = False) -> tuple[dict[str, torch.Tensor | Stacked], dict[str, str]]:
        # numpy converts a list of ints about 3x faster than torch.tensor (39 -> 13 µs for 256
        # ids, a third of a steering-only result's served encoding). int32: every vocabulary
        # fits, and a served result's bytes (base64 inside JSON, escaped and parsed at both
        # ends) are mostly its token ids when it has no activations.
        tensors = {"token_ids": torch.from_numpy(np.array(self.token_ids, dtype=np.int32))} if tokens else {}
        for site, per_layer in self.activations.items():     # may share memory: `st_bytes`
            pos = self.positions[site]
            block = _stack(per_layer, pos, lazy) if stacked else None
            if block is not None:
                tensors[f"{site}.{STACK}"], tensors[f"{site}.{STACK}.positions"] = block
                continue
            for layer, t in per_layer.items():
                tensors[f"{site}.{layer}"] = t if lazy else as_tensor(t)
                tensors[f"{site}.{layer}.positions"] = pos[layer]
        meta = {
            "vllm_hook_version": __version__,
            "model": self.model,
            "request_id": self.request_id,
            "index": str(self.index),
            "prompt_len": str(self.prompt_len),
            # literals for the empty case: a steering-only result's encoding is mostly these
            "sites": json.dumps({s: sorted(v) for s, v in self.activations.items()}) if self.activations else "{}",
            "errors": json.dumps(self.errors) if self.errors else "[]",
            "heads": json.dumps(self.heads) if self.heads else "{}",
        }
        if self.widen_to:
            meta["widen_to"] = self.widen_to
        if self.hook_results:
            hook_tensors, structure = state.encode(self.hook_results, "hook")
            tensors.update(hook_tensors)
            meta["hook_results"] = json.dumps(structure)
        return tensors, meta

    def save(self, path: str | os.PathLike) -> str:
        """One safetensors file: `{site}.{layer}`, `{site}.{layer}.positions`, `token_ids`."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(self.to_bytes())      # one encoding for files and the wire
        self.path = str(path)
        return self.path

    def to_bytes(self, stacked: bool = False, tokens: bool = True) -> bytes:
        """The bytes of the file `save` writes (what served mode sends to other clients). With
        `stacked` (what the plugin's clients are sent): each site whose layers share their
        positions, shape and dtype as one tensor
        `{site}.*` [layers ascending, rows, ...] and one `{site}.*.positions` (served, to a
        client that reads it: 3 tensors instead of 9 for 4 layers, each a cost to encode);
        `from_bytes` and `load` read both. Without `tokens` (served, to a client whose
        response shows the tokens: `server.encode`) there is no `token_ids` tensor: such bytes
        can be made before the request's last token."""
        tensors, meta = self._payload(stacked, tokens)
        return st_bytes(tensors, meta)

    def to_parts(self, stacked: bool = False, tokens: bool = True) -> StParts | bytes:
        """`to_bytes`'s content not yet joined (a large served result: `server.encode`):
        the same tensors and metadata, read by `from_bytes` alike; `to_bytes` itself where a
        tensor's dtype has no safetensors name here (`spill.ST_DTYPES`: a hook's uint32)."""
        tensors, meta = self._payload(stacked, tokens, lazy=True)
        if all(t.dtype in ST_DTYPES for t in tensors.values()):
            return StParts(tensors, meta)
        return st_bytes(tensors, meta)

    @classmethod
    def from_bytes(cls, blob: bytes) -> "Results":
        """Inverse of `to_bytes` (bytes made without `tokens`: no token ids, the caller's to
        set)."""
        return cls._from(*st_tensors(blob, _widened), None)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Results":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return cls._from(load_file(str(path)), meta, str(path))

    @classmethod
    def _from(cls, tensors: dict[str, torch.Tensor], meta: dict, path: str | None) -> "Results":
        out = cls(request_id=meta.get("request_id", ""), prompt_len=int(meta.get("prompt_len", 0)),
                  token_ids=_token_list(tensors.pop("token_ids", None)), index=int(meta.get("index", 0)),
                  model=meta.get("model", ""), errors=_loads(meta.get("errors", "[]"), list),
                  path=path)
        out.heads = {s: {int(k): v for k, v in d.items()}
                     for s, d in _loads(meta.get("heads", "{}"), dict).items()}
        if meta.get("hook_results"):
            out.hook_results = state.decode(json.loads(meta["hook_results"]), tensors)
        widen = torch.float32 if meta.get("widen_to") == "float32" else None
        layers_of = None
        for name, t in tensors.items():
            if name.endswith(".positions") or name.startswith("hook."):
                continue
            site, layer = name.rsplit(".", 1)
            if widen is not None and t.dtype != widen and t.is_floating_point():
                t = t.to(widen)
            pos = tensors[f"{name}.positions"]
            if layer == STACK:        # `to_bytes(stacked=True)`: one tensor for the site's layers
                layers_of = layers_of or json.loads(meta.get("sites") or "{}")
                if len(layers_of.get(site, ())) != t.shape[0]:
                    raise ValueError(f"stacked {site!r} holds {t.shape[0]} layers, its metadata's "
                                     f"sites list {layers_of.get(site)}: not a vllm-hook result")
                acts, at = out.activations.setdefault(site, {}), out.positions.setdefault(site, {})
                for L, rows in zip(layers_of[site], t.unbind(0)):
                    acts[int(L)], at[int(L)] = rows, pos
                continue
            out.activations.setdefault(site, {})[int(layer)] = t
            out.positions.setdefault(site, {})[int(layer)] = pos
        return out


STACK = "*"      # the layer part of a stacked site's name: `{site}.*`


def _token_list(t: torch.Tensor | None) -> list[int]:
    return t.tolist() if t is not None else []


def _stack(per_layer: dict[int, torch.Tensor], pos: dict[int, torch.Tensor], lazy: bool = False
           ) -> tuple[torch.Tensor | Stacked, torch.Tensor] | None:
    """A site's layers as one tensor [layers ascending, ...] and their positions, when they
    share one positions tensor, their shape and dtype (a capture group's do); else None. Rows
    that lie back to back in one block (a request's own group) are that block, viewed; rows
    packed across a fetch's requests are copied (one `torch.stack`), or with `lazy` left
    apart (`Stacked`: written part by part, `to_parts`). Rows not joined yet (`hostmem.Rows`,
    a served request's lent parts) are joined first, or with `lazy` left as they are."""
    if len(per_layer) < 2:
        return None
    layers = sorted(per_layer)
    ts = [per_layer[L] for L in layers]
    if not all(isinstance(t, torch.Tensor) for t in ts):
        if lazy:
            p = pos[layers[0]]
            ok = all(pos[L] is p and t.shape == ts[0].shape and t.dtype == ts[0].dtype for L, t in zip(layers, ts))
            return (Stacked(ts), p) if ok else None
        ts = [as_tensor(t) for t in ts]
    first, p = ts[0], pos[layers[0]]
    shape, dtype = first.shape, first.dtype
    for L, t in zip(layers, ts):
        if pos[L] is not p or t.shape != shape or t.dtype != dtype:
            return None
    step, start = first.nbytes, first.data_ptr()
    if ts[1].data_ptr() == start + step and all(t.is_contiguous() for t in ts):
        storage = first.untyped_storage()
        # consecutive within the first's storage (so they are of it: live storages do not overlap)
        if (start + len(ts) * step <= storage.data_ptr() + storage.nbytes()
                and all(t.data_ptr() == start + i * step for i, t in enumerate(ts))):
            return torch.empty(0, dtype=dtype).set_(storage, first.storage_offset(), (len(ts), *shape)), p
    return (Stacked(ts) if lazy else torch.stack(ts)), p


def _widened(meta: dict, name: str) -> bool:
    """Whether a loaded tensor is widened to float32: activations of a result sent in the
    model's dtype (`Results.widen_to`), not positions, token ids or hook results."""
    return (meta.get("widen_to") == "float32" and not name.endswith(".positions")
            and not name.startswith("hook.") and name != "token_ids")


def _loads(text: str, empty: type) -> Any:
    """json.loads, with the empty case (most results' errors and heads) not parsed."""
    return empty() if text in ("[]", "{}", "") else json.loads(text)


def _merge(parts: list[tuple]) -> tuple[dict, dict, list[str]]:
    """Per-rank (points, metadata) -> {point: (positions, rows)} for the residual points of
    TP rank 0 (of every pipeline stage: each captures its own layers), the raw per-rank pieces
    of the head-sharded points, and the errors of all ranks."""
    if len(parts) == 1:                 # one rank (no tensor parallelism): nothing to sort
        pts, meta, _ = parts[0]
        errs = meta.get("errors")
        return pts, [(pts, meta)], list(dict.fromkeys(errs)) if errs else []
    ranks = sorted(((p, m) for p, m, _ in parts), key=lambda x: (x[1].get("rank", 0), x[1].get("pp_rank", 0)))
    pts = {}
    for p, m in ranks:
        if m.get("rank", 0) == 0:
            pts.update(p)
    # Every rank runs the same hooks and steering: the same failure is reported once.
    errors = list(dict.fromkeys(e for _, m in ranks for e in m.get("errors", [])))
    return pts if ranks else {}, ranks, errors


def _sharded(ranks, point: int, site: str, layer: int, head_size: int):
    """Concatenate head shards of one point across TP ranks, in global head order."""
    pos, parts, heads = None, [], []
    for pts, meta in ranks:
        if point not in pts:
            continue
        p, rows = pts[point]
        if site == "attn_scores":
            hs = meta.get("attn_heads", {}).get(str(point), [])
            parts.append(rows)
        else:
            hs = meta.get("q_heads" if site == "q" else "kv_heads", {}).get(str(layer), [])
            parts.append(rows.reshape(rows.shape[0], -1, head_size))
        heads += hs
        pos = p
    if pos is None:
        return torch.zeros(0, dtype=torch.int64), None, []
    t = torch.cat(parts, dim=1)
    order, seen = [], set()
    for i, h in sorted(enumerate(heads), key=lambda x: x[1]):
        if h not in seen:                       # KV heads replicated across ranks: keep one
            seen.add(h)
            order.append(i)
    return pos, t[:, order], [heads[i] for i in order]


def _hook_results(ranks, n: int, errors: list[str]) -> list[dict]:
    """The saved dicts of the request's n hooks, from TP rank 0 (every TP rank runs the hooks)
    of each pipeline stage (each runs them at its own layers), merged (`state.merge_stages`)."""
    stages = [meta for _, meta in ranks if meta.get("rank", 0) == 0]
    missing = [m.get("pp_rank", 0) for m in stages if "hooks" not in m]
    stages = [m for m in stages if "hooks" in m]
    if missing and not errors:
        errors.append("no hook results arrived from the workers for this request"
                      + (f" (pipeline stage {missing[0]})" if stages else ""))
    if not stages:
        return [{} for _ in range(n)]
    got = state.merge_stages([[dict(g) if isinstance(g, dict) else {} for g in state.decode(m["hooks"], m.get("tensors", {}))]
                              for m in stages], [m.get("pp_rank", 0) for m in stages])
    return got + [{}] * (n - len(got))


def _parsed(blob) -> tuple:
    """(points, metadata, whether the frontend owns the memory) of one request's part: a
    pre-parsed part (`frontend.delivery.Opened`), or its bytes / the tensor a file was read into."""
    if isinstance(blob, tuple):
        return blob
    pts, meta = points_from_bytes(blob)
    return pts, meta, isinstance(blob, torch.Tensor)


def _dense(part: tuple) -> tuple:
    """`part` with its rows left as lent parts (`hostmem.Rows`, served) joined: `build`'s
    general path reads rows, only `_build_fresh` hands them on as they are."""
    pts = part[0]
    if all(isinstance(rows, torch.Tensor) for _, rows in pts.values()):
        return part
    return {p: (pos, as_tensor(rows)) for p, (pos, rows) in pts.items()}, *part[1:]


_PLANS: dict[int, tuple[list, PointTable, list]] = {}
_WANT: dict[tuple, np.ndarray] = {}
_EMPTY_POS = torch.zeros(0, dtype=torch.int64)


def _plan(items: list[dict], points: PointTable) -> list[tuple]:
    """The spec's items per (site, layer): [(site, layer, point, selectors, heads wanted)]. A
    batch's requests share one items list (`frontend.cache`): planned once, not per request."""
    got = _PLANS.get(id(items))
    if got is not None and got[0] is items and got[1] is points:
        return got[2]
    groups: dict[tuple[str, int], list[tuple[str, tuple]]] = {}
    heads: dict[tuple[str, int], set[int]] = {}
    for it in items:
        groups.setdefault((it["site"], it["layer"]), []).append((it["sel"], tuple(it["pos"])))
        if "heads" in it:
            heads.setdefault((it["site"], it["layer"]), set()).update(it["heads"])
    plan = [(site, layer, points.col(site, layer), tuple(sels), sorted(heads.get((site, layer), ())))
            for (site, layer), sels in groups.items()]
    if len(_PLANS) >= 256:
        _PLANS.clear()
    # The entry keeps items (and points) alive: their ids are not reused.
    _PLANS[id(items)] = (items, points, plan)
    return plan


def _wanted(sels: tuple, P: int, limit: int) -> np.ndarray:
    """The positions (ascending) that `sels` select of a request with P prompt tokens whose
    rows end before `limit`."""
    key = (sels, P, limit)
    got = _WANT.get(key)
    if got is None:
        want = np.zeros(limit, dtype=bool)
        for sel, plist in sels:
            if sel == "last":
                want[limit - 1] = True
            else:
                want |= selected_mask(sel, plist, np.arange(limit), P)
        got = np.nonzero(want)[0]
        if got.nbytes <= 64 << 10:
            if len(_WANT) >= 512:
                _WANT.clear()
            _WANT[key] = got
    return got


def _selection(got: list, limit: int) -> tuple:
    """(rows wanted: a mask, their count, whether they are a prefix, their positions, the
    wanted positions missing) of a positions entry of `build` ([pos, pos_np, want, exact]):
    computed once per request and selection, kept in the entry, shared by the group's layers."""
    if len(got) > 4:
        return got[4]
    pos_np, want = got[1], got[2]
    keep = pos_np < limit
    kept = pos_np[keep]
    # np.isin, for `want` ascending without repeats: about 20x faster at these sizes
    at = np.searchsorted(want, kept)
    mask = want[np.minimum(at, len(want) - 1)] == kept if len(want) else np.zeros(len(kept), dtype=bool)
    sel = keep.copy()
    sel[keep] = mask
    k = int(mask.sum())
    found = kept[mask]
    # `found` is a subset of `want`, without repeats: equal counts mean nothing is missing
    missing = np.setdiff1d(want, found) if len(found) != len(want) else ()
    got.append((sel, k, bool(sel[:k].all()), torch.from_numpy(found.astype(np.int64)), missing))
    return got[4]


def _exactly(pos_np: np.ndarray, want: np.ndarray) -> bool:
    n = want.shape[0]
    if pos_np.shape[0] != n:
        return False
    return bool(pos_np[0] == want[0]) if n == 1 else bool((pos_np == want).all())


def _simple(plan: list[tuple]) -> bool:
    """Whether a plan reads each captured point once, and no head-sharded site."""
    got = _SIMPLE.get(id(plan))
    if got is None or got[0] is not plan:
        if len(_SIMPLE) >= 256:             # bounded, as `_PLANS` (the entry keeps its plan alive)
            _SIMPLE.clear()
        got = _SIMPLE[id(plan)] = (plan, all(site not in ("q", "k", "attn_scores") for site, *_ in plan)
                                   and len({point for _, _, point, _, _ in plan}) == len(plan))
    return got[1]


_SIMPLE: dict[int, tuple[list, bool]] = {}


def _build_fresh(part: tuple, items: list[dict], points: PointTable, P: int, limit: int,
                 request_id: str, index: int, model: str, token_ids: list[int]) -> Results | None:
    """`build`'s common case, with the same result: one rank, rows the payload's parse made
    fresh (a small capture), exactly the selected positions of each point captured. None
    otherwise (the general path decides). Most of a small capture's delivery was `build`'s
    general bookkeeping (26 µs a request on the CI machine)."""
    pts, meta, _ = part
    plan = _plan(items, points)
    fresh = meta.get("_fresh")
    if not fresh or not _simple(plan) or meta.get("errors"):
        return None
    acts: dict[str, dict[int, torch.Tensor]] = {}
    poss: dict[str, dict[int, torch.Tensor]] = {}
    last = None
    for site, layer, point, sels, _ in plan:
        got = pts.get(point)
        if got is None or point not in fresh:
            return None
        pos = got[0]
        if last is None or pos is not last[0] or sels != last[1]:
            want = _wanted(sels, P, limit)
            n = want.shape[0]
            # one position (a last-token capture): `item` is a fifth of `numpy`'s cost
            if pos.shape[0] != n or not (pos.item() == want[0] if n == 1 else _exactly(pos.numpy(), want)):
                return None
            last = (pos, sels)
        a = acts.get(site)
        if a is None:
            a = acts[site] = {}
            poss[site] = {}
        a[layer] = got[1]
        poss[site][layer] = pos
    res = Results.__new__(Results)
    res.__dict__.update(request_id=request_id, prompt_len=P, token_ids=token_ids, activations=acts,
                        positions=poss, errors=[], index=index, model=model, path=None, heads={},
                        hook_results=[], widen_to=None)
    return res


def build(blobs: bytes | torch.Tensor | list | None, items: list[dict], points: PointTable, *,
          request_id: str, prompt_token_ids: list[int], output_token_ids: list[int], index: int = 0,
          model: str = "", extra_errors: list[str] | None = None, head_size: int = 0,
          dtype: str = "float32", hooks: int = 0) -> Results:
    """Assemble a request's results from the workers' per-point rows (one blob per TP rank
    that captured anything) and the spec's items, in `dtype` ("float32", or "model": the
    captured dtype). Rows the payload's parse already made fresh in `dtype` (`_fresh`: packed
    small captures, converted once per fetch) and, in the model dtype, rows of a blob the
    frontend owns (a uint8 tensor a spilled file was read into) are used as they are when
    every row is selected; everything else is copied."""
    if isinstance(blobs, (bytes, bytearray, torch.Tensor)):
        blobs = [blobs]
    parts = [_parsed(b) for b in blobs or []]
    P = len(prompt_token_ids)
    limit = P + max(len(output_token_ids), 1) - 1
    if len(parts) == 1 and items and not hooks and not extra_errors:
        res = _build_fresh(parts[0], items, points, P, limit, request_id, index, model,
                           [*prompt_token_ids, *output_token_ids])
        if res is not None:
            return res
    parts = [_dense(p) for p in parts]
    pts, ranks, errors = _merge(parts)
    res = Results(request_id=request_id, prompt_len=P, index=index, model=model,
                  token_ids=[*prompt_token_ids, *output_token_ids],
                  errors=errors + list(extra_errors or []))
    if hooks:
        res.hook_results = _hook_results(ranks, hooks, res.errors)
    if not items:
        return res
    copies: list[tuple[str, int, torch.Tensor]] = []
    owned, used = bool(parts) and all(o for _, _, o in parts), set()
    fresh = ranks[0][1].get("_fresh", ()) if len(ranks) == 1 else \
        set().union(*(m.get("_fresh", ()) for _, m in ranks if m.get("rank", 0) == 0))
    # The points of a captured group share one positions tensor, and a spec's layers mostly
    # one selection: each is converted and compared once per request, not per layer.
    exact: dict[tuple[int, tuple], tuple] = {}
    for site, layer, point, sels, want_h in _plan(items, points):
        if site in ("q", "k", "attn_scores"):
            pos, rows, heads = _sharded(ranks, point, site, layer, head_size)
            if rows is not None:
                idx = [heads.index(h) for h in want_h if h in heads]
                rows, heads = rows[:, idx], [heads[i] for i in idx]
            res.heads.setdefault(site, {})[layer] = heads
            if set(heads) != set(want_h):
                res.errors.append(f"{site} layer {layer}: heads {sorted(set(want_h) - set(heads))} "
                                  "were not captured")
            fresh_rows = False
        else:
            pos, rows = pts.get(point, (_EMPTY_POS, None))
            fresh_rows = point in fresh
        key = (id(pos), sels)
        got = exact.get(key)
        if got is None or got[0] is not pos:
            pos_np, want = pos.numpy(), _wanted(sels, P, limit)
            got = exact[key] = [pos, pos_np, want, _exactly(pos_np, want)]
        is_exact = got[3]
        acts = res.activations.setdefault(site, {})
        if rows is not None and is_exact:
            # The common case: exactly the selected rows were captured.
            if (fresh_rows or (dtype == "model" and owned)) and id(rows) not in used:
                used.add(id(rows))                 # resid_pre L+1 is resid_post L: one view each
                acts[layer] = rows
            else:
                copies.append((site, layer, rows))
            res.positions.setdefault(site, {})[layer] = pos
            continue
        sel, k, prefix, got_pos, missing = _selection(got, limit)
        if rows is None:
            acts[layer] = torch.zeros(0, 0)
        elif prefix:
            # A prefix (the common case: a surplus step's rows at the end): a view, used as it
            # is when fresh (the parse's conversion), not copied a second time.
            whole, rows = rows, rows[:k]
            if (fresh_rows or (dtype == "model" and owned)) and id(whole) not in used:
                used.add(id(whole))
                acts[layer] = rows
            else:
                copies.append((site, layer, rows))
        else:
            copies.append((site, layer, rows[torch.from_numpy(sel)]))
        res.positions.setdefault(site, {})[layer] = got_pos
        if len(missing):
            res.errors.append(f"{site} layer {layer}: {len(missing)} selected rows were not "
                              f"captured (positions {missing[:8].tolist()}...)")
    if not copies:
        return res
    # The rest is copied, each site/layer its own (resid_pre L+1 and resid_post L are one
    # captured point), into one block of host memory: float32 conversions, rows of RPC bytes
    # (read-only), selections.
    # In the order the rows lie in the buffer they were read into: the copies then coalesce.
    copies.sort(key=lambda c: (c[2].untyped_storage().data_ptr(), c[2].storage_offset()))
    out = [torch.float32 if dtype == "float32" else rows.dtype for _, _, rows in copies]
    sizes = [-(-rows.numel() * dt.itemsize // 64) * 64 for (_, _, rows), dt in zip(copies, out)]
    block, at, pairs = host_empty((sum(sizes),), torch.uint8), 0, []
    for (site, layer, rows), dt, size in zip(copies, out, sizes):
        t = block[at:at + rows.numel() * dt.itemsize].view(dt).view(rows.shape)
        res.activations[site][layer] = t
        pairs.append((t, rows))
        at += size
    copy_many(pairs, parallel_from=CHUNK_BYTES)
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
