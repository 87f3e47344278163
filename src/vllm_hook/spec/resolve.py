"""Check a parsed spec against the model, the engine config and the prompt; emit the wire form.

The wire form is what workers receive inside `SamplingParams.extra_args`: plain msgpack-able
values only (ints, floats, str, bytes, lists, dicts), layers non-negative, positions absolute,
vectors as float32 bytes or registered names, each steering op reduced to five coefficients
of one formula (see `model/steering.py`).
"""

from __future__ import annotations

import hashlib
import math
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np

from ..config import HookConfig
from .errors import SpecError, UnknownVectorError
from .hooks import resolve_hooks
from .schema import AblateOp, AddOp, CapOp, HookSpec, Selector
from .vectors import check_vector, decode_vector, vector_digest

WIRE_VERSION = 1
_PACK = msgspec.msgpack.Encoder()


STEER_COLUMNS = ("layer", "sel", "pos", "c", "digest", "name", "vec")


def pack_steer(cols: dict[str, list]) -> bytes:
    """A wire's steering ops as one msgpack blob of columns (`STEER_COLUMNS`; "c" the ops'
    five numbers each as float64 bytes, `coef_bytes`; "name" or "vec" None where the op has
    the other): vLLM serialises each request's extra_args to the engine core field by field
    (24 µs a request on the CPU to decode a 28-op list), a blob in one piece, and columns let
    the worker check and admit a new spec's ops in array operations. A worker whose requests
    already steer alike never opens it."""
    return _PACK.encode({**cols, "c": coef_bytes(cols["c"])})


def coef_bytes(c) -> bytes:
    """Steering coefficients (flat, five an op) as float64 bytes: the worker reads them with
    one `np.frombuffer`, and their digest (`digest_of`) is of their values, not of how a list
    spelled them (0 and 0.0 alike)."""
    if isinstance(c, (bytes, bytearray)):
        return bytes(c)
    return _float64s(len(c)).pack(*c)


_STRUCTS: dict[int, struct.Struct] = {}


def _float64s(n: int) -> struct.Struct:
    got = _STRUCTS.get(n)
    if got is None:
        got = struct.Struct(f"<{n}d")
        if len(_STRUCTS) < 64:
            _STRUCTS[n] = got
    return got


def _columns(ops: list[dict]) -> dict[str, list]:
    cols: dict[str, list] = {k: [op.get(k) for op in ops] for k in STEER_COLUMNS if k != "c"}
    cols["c"] = [x for op in ops for x in (op.get("c") or ())]
    return cols


def unpack_steer(ops: bytes | list) -> dict[str, list]:
    """The columns of a wire's "steer" (a blob, "c" as float64 bytes; or a list of op dicts in a
    wire made by hand, "c" a list)."""
    if isinstance(ops, (bytes, bytearray, memoryview)):
        return msgspec.msgpack.decode(ops)
    return _columns([op if isinstance(op, dict) else {} for op in ops])


def coefficients(c) -> list[float]:
    """A wire's "c" column as a list of floats (`coef_bytes` or a list)."""
    if isinstance(c, (bytes, bytearray)):
        return list(_float64s(len(c) // 8).unpack(c))
    return list(c)


def steer_ops(ops: bytes | list) -> list[dict]:
    """The ops of a wire's "steer", one dict each (for reading and tests)."""
    cols = unpack_steer(ops)
    c = coefficients(cols["c"])
    return [{**{k: cols[k][i] for k in STEER_COLUMNS if k != "c" and cols[k][i] is not None},
             "c": c[5 * i:5 * i + 5]} for i in range(len(cols["layer"]))]


# Distinct (site, layer, selector) captures of one spec: 7 sites x 128 layers x 4 selectors fit.
MAX_CAPTURE_ENTRIES = 4096


@dataclass(frozen=True)
class ModelInfo:
    num_layers: int
    hidden_size: int
    name: str = ""
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "float32"          # the dtype the model computes in (torch's name)



_DTYPE_MAX = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38,
              "float16": 65504.0}


def steer_bound(model: ModelInfo, max_ops_per_layer: int) -> float:
    """The largest update one steering op may make to a row (the norm of its b*u).

    Chosen so that even every op of every layer at this size keeps the residual stream
    finite in the model's dtype and its squared norm finite in float32 (what the next
    RMSNorm computes): a request can never make the plugin write inf or NaN into the
    stream, nor into the KV cache that later requests reuse. Additive ops beyond it are
    refused at admission; stream-dependent ones (norm_match, cap, ablate) are clamped to it
    in the model (`model/steering.py`)."""
    big = min(math.sqrt(_DTYPE_MAX["float32"]), _DTYPE_MAX.get(model.dtype, _DTYPE_MAX["float16"]))
    return big / (4.0 * max(model.num_layers, 1) * max(max_ops_per_layer, 1))


@dataclass
class Resolved:
    """A request's spec after resolution: the wire dict plus what only the frontend needs."""

    wire: dict
    key: str
    prompt_len: int
    save_dir: str | None
    steer_digest: str | None
    reads_cached_prefix: bool
    items: list[dict] = field(default_factory=list)
    dtype: str = "float32"
    hooks: int = 0                 # hooks in the spec: Results.hook_results has one per hook
    stack_layers: tuple[int, ...] | None = None   # vllm-lens output_residual_stream: out.activations
    ticket: int = 0                # steering only: its clean mark's ticket (delivery.arena), 0: none
    clean: bool = False            # its clean mark was seen at its finish (`nothing_to_fetch`)
    steer_norms: tuple[float, ...] = ()   # each steering op's vector norm (`spec.rescale`)
    # the shortest prompt for which its captures read a cached prefix (`cached_prefix_from`):
    # a copy for another prompt length sets `reads_cached_prefix` by one comparison
    prefix_from: float = math.inf
    # capture_bytes by (prompt length, total length), shared by the copies the frontend cache hands out
    worst_bytes: dict = field(default_factory=dict, repr=False, compare=False)

    held: bool = False             # fetched while it decodes (`FetchBatcher.hold`)
    # When its rows may be widened on the device (`frontend.admission._widen_on_device`): 2
    # always (its captures pick prompt rows only), 1 when it generates one token, 0 never
    # (none, or attention scores: float32 already). Its positions are absolute: a copy for
    # another prompt length is of a spec without any (`frontend.cache`).
    widen_when: int = 0

    @property
    def fetches(self) -> bool:
        """Whether its results are more than its tokens (worker errors always are)."""
        return bool(self.items or self.hooks)

    @property
    def whole_at_prefill(self) -> bool:
        """Its results are complete once its prompt is processed: captures of prompt tokens
        only (no generated token, steering or hook), which workers route no more after it."""
        return bool(self.items) and not self.hooks and not self.wire.get("steer") and all(
            it["sel"] in ("prompt", "last_prompt") or (it["sel"] == "pos" and it["pos"][-1] < self.prompt_len)
            for it in self.items)


def _selector(sel: Selector, prompt_len: int, where: str) -> tuple[str, list[int]]:
    if isinstance(sel, str):
        return sel, []
    out = []
    for i, p in enumerate(sel):
        a = p + prompt_len if p < 0 else p
        if a < 0:
            raise SpecError(f"{where}[{i}]", f"position {p} is before the start of the "
                            f"{prompt_len}-token prompt",
                            f"use a position in [-{prompt_len}, max_model_len)")
        out.append(a)
    if not out:
        raise SpecError(where, "empty position list", 'list at least one position or use "all"')
    return "pos", sorted(set(out))


ATTN_SITES = ("q", "k", "attn_scores")


def _dict_layer(key, n: int, where: str) -> int:
    try:
        return _layer(int(key), n, where)
    except ValueError:
        raise SpecError(where, f"heads key {key!r} is not a layer index",
                        'use {"<layer>": [heads]}, e.g. {"3": [0, 5]}') from None


def _heads(spec_heads, layer: int, n_layers: int, total: int, where: str) -> list[int]:
    if spec_heads is None or spec_heads == "all":
        return list(range(total))
    if isinstance(spec_heads, dict):
        chosen = None
        for k, v in spec_heads.items():
            if _dict_layer(k, n_layers, where) == layer:
                chosen = v
        if chosen is None:
            raise SpecError(where, f"no heads listed for layer {layer}",
                            f'add "{layer}": [...] or drop the layer from layers')
        spec_heads, where = chosen, f"{where}[{layer!r}]"
    if not spec_heads:
        raise SpecError(where, "empty head list", 'list at least one head or use "all"')
    for h in spec_heads:
        if not 0 <= h < total:
            raise SpecError(where, f"head {h} is out of range: this layer has {total} "
                            f"head{'s' if total != 1 else ''}", f"use heads 0..{total - 1}")
    return sorted(set(spec_heads))


def _layer(layer: int, n: int, where: str) -> int:
    if not -n <= layer < n:
        raise SpecError(where, f"layer {layer} is out of range for a {n}-layer model",
                        f"use 0..{n - 1}, or -1..-{n} to count from the last layer")
    return layer % n


def _frozen(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, dict):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    return v


def resolve(
    spec: HookSpec,
    model: ModelInfo,
    config: HookConfig,
    prompt_len: int,
    known_vectors: Callable[[str], str | None],
    max_model_len: int | None = None,
    allow_pickles: bool = True,
) -> Resolved:
    """Validate `spec` for this model and prompt. `known_vectors(name)` returns (digest, norm)
    of a registered vector, or None."""
    n, hidden = model.num_layers, model.hidden_size
    bound = steer_bound(model, config.max_ops_per_layer)
    wire_cap, items, seen_items = [], [], set()
    for i, item in enumerate(spec.capture):
        where = f"capture[{i}]"
        ikey = (item.site, _frozen(item.layers), _frozen(item.tokens), _frozen(item.heads))
        if ikey in seen_items:            # a repeated item adds nothing: checked once
            continue
        seen_items.add(ikey)
        site = item.site
        needs = "q" if site == "attn_scores" else site
        if needs not in config.sites:
            raise SpecError(f"{where}.site", f"site {site!r} needs {needs!r}, which is not instrumented "
                            "in this engine", f"start the engine with additional_config "
                            f"vllm_hook.sites including {needs!r}")
        site_layers = (set(range(n)) if needs in ("resid_post", "resid_pre")
                       else config.layers_of(config.site_layers, n))
        if item.heads is not None and site not in ATTN_SITES:
            raise SpecError(f"{where}.heads", f"heads applies to q, k and attn_scores, not {site!r}",
                            "remove heads")
        layers = item.layers
        if isinstance(item.heads, dict) and layers == "all":
            layers = [_dict_layer(k, n, f"{where}.heads") for k in item.heads]
        layers = list(range(n)) if layers == "all" else layers
        if not layers:
            raise SpecError(f"{where}.layers", "empty layer list", 'list at least one layer or use "all"')
        tokens = item.tokens if item.tokens is not None else ("last_prompt" if site == "attn_scores" else "all")
        sel, pos = _selector(tokens, prompt_len, f"{where}.tokens")
        if max_model_len and pos and pos[-1] >= max_model_len:
            raise SpecError(f"{where}.tokens", f"position {pos[-1]} is beyond max_model_len={max_model_len}",
                            "use positions inside the sequence")
        if site == "attn_scores" and (sel not in ("last_prompt", "prompt", "pos")
                                      or (pos and pos[-1] >= prompt_len)):
            raise SpecError(f"{where}.tokens", "attn_scores query tokens must be prompt tokens",
                            'use "last_prompt", "prompt" or prompt positions')
        if item.layers == "all" and not isinstance(item.heads, dict):
            layers = sorted(site_layers)
        seen: set[int] = set()
        for j, layer in enumerate(layers):
            L = _layer(layer, n, f"{where}.layers[{j}]" if item.layers != "all" else f"{where}.layers")
            if L not in site_layers:
                raise SpecError(f"{where}.layers", f"site {needs!r} is not instrumented at layer {L} "
                                f"(instrumented: {sorted(site_layers)})",
                                "start the engine with additional_config vllm_hook.site_layers "
                                f"including {L}")
            if L in seen:                 # a layer listed twice (or as -1 and n-1): once
                continue
            seen.add(L)
            entry = {"site": site, "layer": L, "sel": sel, "pos": pos}
            if site in ATTN_SITES:
                total = model.num_kv_heads if site == "k" else model.num_heads
                entry["heads"] = _heads(item.heads, L, n, total, f"{where}.heads")
            wire_cap.append(entry)
            items.append(dict(entry))
    # Equal entries of several items travel once (keyed without re-serialising their lists).
    dedup: dict[tuple, dict] = {}
    for c in wire_cap:
        dedup.setdefault((c["site"], c["layer"], c["sel"], tuple(c["pos"]), tuple(c.get("heads", ()))), c)
    wire_cap = list(dedup.values())
    if len(wire_cap) > MAX_CAPTURE_ENTRIES:
        raise SpecError("capture", f"{len(wire_cap)} distinct (site, layer, tokens) captures, more than "
                        f"{MAX_CAPTURE_ENTRIES}", "merge items that differ only in their tokens, or split "
                        "the work over requests")

    cols: dict[str, list] = {k: [] for k in STEER_COLUMNS}       # the wire's steering columns
    c_layer, c_sel, c_pos, c_coef, c_digest, c_name, c_vec = (cols[k] for k in STEER_COLUMNS)
    per_layer: dict[int, list[tuple[int, bool]]] = {}
    norms: list[float] = []
    # The engine's steering and projection layers, once per spec, not per op
    steer_layers = config.steering_layers(n) if spec.steer else set()
    proj_layers = config.layers_of(config.projection_layers, n) if spec.steer else set()
    for i, op in enumerate(spec.steer):
        where = f"steer[{i}]"
        L = _layer(op.layer, n, f"{where}.layer")
        sel, pos = _selector(op.tokens, prompt_len, f"{where}.tokens")
        if max_model_len and pos and pos[-1] >= max_model_len:
            raise SpecError(f"{where}.tokens", f"position {pos[-1]} is beyond max_model_len={max_model_len}",
                            "use positions inside the sequence")
        inf = math.inf
        if isinstance(op, AddOp):
            coef = [0.0, op.scale, 0.0, -inf, inf] if op.norm_match else [op.scale, 0.0, 0.0, -inf, inf]
            need_norm = op.norm_match
        elif isinstance(op, CapOp):
            lo = -inf if op.min is None else op.min
            hi = inf if op.max is None else op.max
            if op.min is None and op.max is None:
                raise SpecError(where, "cap needs min, max or both", 'add "min" and/or "max"')
            if lo > hi:
                raise SpecError(where, f"min {lo} is greater than max {hi}", "swap or fix the bounds")
            if lo == inf or hi == -inf:
                raise SpecError(where, f"min {lo}, max {hi}: no projection lies within them",
                                "pass finite bounds, or leave one out")
            coef = [0.0, 0.0, 0.0, lo, hi]
            need_norm = True
        else:
            assert isinstance(op, AblateOp)
            coef = [0.0, 0.0, op.scale - 1.0, -inf, inf]
            need_norm = True
        per_layer.setdefault(L, []).append((i, need_norm))
        if not need_norm and L not in steer_layers:
            raise SpecError(f"{where}.layer", f"this engine has no steering at layer {L}",
                            "start the engine with additional_config vllm_hook.steer_layers "
                            f'including {L} (or "all")')
        if need_norm and L not in proj_layers:
            kind = "norm-matched add" if isinstance(op, AddOp) else op.op
            raise SpecError(f"{where}.op", f"{kind} at layer {L} needs projection support, which "
                            "this engine has not enabled there",
                            "start the engine with additional_config vllm_hook.projection_layers "
                            f'including {L} (or "all"), or use a plain add')
        s0, s1, s2, lo, hi = coef
        # One comparison chain when every check below passes (NaN fails it too)
        if not (abs(s0) <= bound and abs(s1) <= bound and abs(s2 + 1.0) <= bound
                and (lo == -inf or abs(lo) <= bound) and (hi == inf or abs(hi) <= bound)):
            _check_coefficients(coef, bound, where, model)
        vec = decode_vector(op.vector, f"{where}.vector")
        if isinstance(vec, str):
            known = known_vectors(vec)
            if known is None:
                raise UnknownVectorError(f"{where}.vector", f"no registered vector named {vec!r}",
                                         "register it first (vllm_hook.register_vectors or "
                                         "POST /v1/hook/vectors) or pass the values inline")
            digest, norm = known
            name, raw = vec, None
        else:
            arr = check_vector(vec, hidden, f"{where}.vector", need_norm)
            digest, norm = vector_digest(arr), float(np.linalg.norm(arr.astype(np.float64)))
            name, raw = None, arr.tobytes()
        if coef[0] and abs(coef[0]) * norm > bound:
            raise SpecError(f"{where}.scale", f"scale x ||vector|| = {abs(coef[0]) * norm:.3g} exceeds "
                            f"{bound:.3g}, the largest update this model's {model.dtype} residual "
                            "stream can carry without overflowing",
                            f"use |scale| <= {bound / norm:.3g} with this vector")
        c_layer.append(L)
        c_sel.append(sel)
        c_pos.append(pos)
        c_coef += coef
        c_digest.append(digest)
        c_name.append(name)
        c_vec.append(raw)
        norms.append(norm)

    _check_slots(cols["sel"], cols["pos"], per_layer, config.max_ops_per_layer)
    steer_digest = steer_shape = None
    if spec.steer:
        # Steering alike but for its coefficients: the workers share what does not depend on
        # them (`worker.runtime`, steering shapes)
        cols["c"] = coef_bytes(cols["c"])
        shape = shape_bytes(cols)
        steer_shape = hashlib.sha256(shape).hexdigest()[:24]
        steer_digest = digest_of(shape, cols["c"])

    # Cached prefix tokens are never recomputed, so their activations would not exist.
    # vLLM always recomputes the last prompt token, so only earlier positions force a recompute.
    prefix_from = cached_prefix_from(wire_cap)
    reads_cached = prompt_len >= prefix_from

    wire_hooks = resolve_hooks(spec.hooks, n, config.layers_of(config.hook_layers, n), allow_pickles,
                               tuple(config.hook_modules)) if spec.hooks else []

    key = uuid.uuid4().hex
    wire = {"v": WIRE_VERSION, "key": key, "P": prompt_len, "cap": wire_cap,
            "steer": pack_steer(cols) if spec.steer else []}
    if steer_digest:
        wire["sd"] = steer_digest      # workers share the table rows of equal steering
        wire["ss"] = steer_shape
    if wire_cap:                       # and the routes of equal captures
        # (its dicts are built in one key order: no sorting needed)
        wire["cd"] = hashlib.sha256(_PACK.encode(wire_cap)).hexdigest()[:24]
    if wire_hooks:
        wire["hooks"] = wire_hooks
    return Resolved(wire=wire, key=key, prompt_len=prompt_len,
                    save_dir=spec.save.dir if spec.save else None, steer_digest=steer_digest,
                    reads_cached_prefix=reads_cached, items=items, dtype=spec.dtype,
                    hooks=len(wire_hooks), steer_norms=tuple(norms), prefix_from=prefix_from,
                    widen_when=_widen_when(items, prompt_len))


def _widen_when(items: list[dict], prompt_len: int) -> int:
    """`Resolved.widen_when` of captures `items`."""
    if not items or any(it["site"] == "attn_scores" for it in items):
        return 0
    return 2 if all(it["sel"] in ("prompt", "last_prompt") or (it["sel"] == "pos" and it["pos"][-1] < prompt_len)
                    for it in items) else 1


def shape_bytes(cols: dict[str, list]) -> bytes:
    """What a spec's steering is but for its coefficients (layers, tokens, vectors by digest,
    whatever their names), encoded: its shape's digest ("ss") and, with the coefficients,
    its steering's (`digest_of`) are of these bytes."""
    return _PACK.encode([cols["layer"], cols["sel"], cols["pos"], cols["digest"]])


def digest_of(shape: bytes, c: bytes) -> str:
    """The digest of a spec's steering: its `shape_bytes` and coefficients (`coef_bytes`);
    equal layers, tokens, coefficients and vectors (by digest, whatever their names), equal
    digest."""
    return hashlib.sha256(shape + c).hexdigest()[:24]


def _check_coefficients(coef: list[float], bound: float, where: str, model: ModelInfo) -> None:
    """A steering op's coefficients finite (bounds not NaN) and within `bound`."""
    for c in coef[:3]:
        if not math.isfinite(c):
            raise SpecError(f"{where}.scale", f"scale is {c}", "pass a finite number")
    for name, c in (("min", coef[3]), ("max", coef[4])):
        if math.isnan(c):
            raise SpecError(f"{where}.{name}", f"{name} is NaN", "pass a finite number or leave it out")
    for name, c in (("scale", max(abs(coef[1]), abs(coef[2] + 1.0) if coef[2] else 0.0)),
                    ("min", abs(coef[3])), ("max", abs(coef[4]))):
        if math.isfinite(c) and c > bound:
            raise SpecError(f"{where}.{name}", f"|{name}| = {c:.3g} exceeds {bound:.3g}, the largest "
                            f"update this model's {model.dtype} residual stream can carry without "
                            "overflowing", f"use a {name} of at most {bound:.3g} in magnitude")


def _check_slots(sels: list[str], poss: list[list[int]], per_layer: dict[int, list[tuple[int, bool]]],
                 K: int) -> None:
    """At most K ops on any row of a layer (ops on disjoint positions share a slot), and the
    projection math well defined (`routing.op_slots`)."""
    from ..routing import op_slots

    for L, ops in per_layer.items():
        idx = [i for i, _ in ops]
        if len(idx) == 1:
            continue
        slots, _, ambiguous = op_slots([(sels[i], poss[i]) for i in idx])
        for i, slot in zip(idx, slots):
            if slot >= K:
                raise SpecError(f"steer[{i}].layer", f"more than {K} steering ops on one token at layer {L}",
                                "merge ops, give them disjoint token positions, or raise "
                                "additional_config vllm_hook.max_ops_per_layer")
        if ambiguous and any(norm for _, norm in ops):
            i = next(i for i, norm in ops if norm)
            raise SpecError(f"steer[{i}]", f"at layer {L}, an op covers tokens of several per-position ops "
                            "of one slot, and a projection op (cap, ablate or norm_match) is there too",
                            "steer those positions with one vector each, or move the projection op to "
                            "another layer")


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def capture_bytes(items: list[dict], model: ModelInfo, prompt_len: int, total_len: int) -> int:
    """Worst-case host bytes of a request's captures on one worker: every row its selectors
    can pick over `total_len` tokens (prompt + max_tokens), in the model's dtype."""
    size = _ITEMSIZE.get(model.dtype, 4)
    rows: dict[tuple[str, int], int] = {}
    per_row: dict[tuple[str, int], int] = {}
    for it in items:
        sel, site = it["sel"], it["site"]
        n = {"all": total_len, "prompt": prompt_len, "generated": max(total_len - prompt_len, 0),
             "last_prompt": 1, "last": 2}.get(sel, len(it.get("pos") or ()))
        key = (site, it["layer"])
        rows[key] = min(rows.get(key, 0) + n, total_len)
        heads = len(it.get("heads") or ())
        per_row[key] = max(per_row.get(key, 0), (
            heads * prompt_len * 4 if site == "attn_scores"          # float32 weights per key
            else heads * model.head_dim * size if site in ("q", "k")
            else model.hidden_size * size))
    return sum(n * per_row[k] for k, n in rows.items())


def cached_prefix_from(wire_cap: list[dict]) -> float:
    """The shortest prompt for which captures `wire_cap` need prompt rows a cached prefix would
    skip (inf: none). vLLM always recomputes the last prompt token, so "all" and "prompt" need
    a prompt of 2 tokens, a position p one of p + 2, other selectors none."""
    low = math.inf
    for cap in wire_cap:
        sel = cap["sel"]
        if sel in ("all", "prompt"):
            low = min(low, 2)
        elif sel == "pos" and cap["pos"]:
            low = min(low, min(cap["pos"]) + 2)
    return low


def selected_mask(sel: str, pos_list, positions, prompt_len: int):
    """Which of `positions` a selector picks (shared by routing and result assembly): a bool
    array for an array of positions, a bool for one int position (a decode row; no numpy)."""
    one = isinstance(positions, int)
    if sel == "all":
        return True if one else np.ones(positions.shape, dtype=bool)
    if sel == "prompt":
        return positions < prompt_len
    if sel == "generated":
        return positions >= prompt_len
    if sel == "last_prompt":
        return positions == prompt_len - 1
    if sel == "last":
        # The positions whose output is sampled: the last prompt token and every generated one.
        return positions >= prompt_len - 1
    if sel == "pos":
        return positions in pos_list if one else np.isin(positions, np.asarray(pos_list, dtype=positions.dtype))
    raise ValueError(f"unknown selector {sel!r}")
