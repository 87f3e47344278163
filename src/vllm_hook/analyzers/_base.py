"""What the analyzers share: config loading, head sets, spans and reading attention rows.

Every user mistake raises `ValueError` with what is wrong and how to fix it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

# {"<layer>": [head, ...]} (JSON keys are strings) or [[layer, head], ...] (Attention Tracker's
# original format); normalised to {layer: sorted unique heads}.
HeadsLike = Union[Mapping[Any, Sequence[int]], Sequence[Sequence[int]]]
Span = tuple[int, int]

ATTN = "attn_scores"


def normalize_heads(heads: HeadsLike, *, where: str = "heads", num_layers: int | None = None,
                    num_heads: int | None = None) -> dict[int, list[int]]:
    """`{layer: [heads]}` with 0-based, in-range indices; ValueError naming the bad entry."""
    pairs: list[tuple[Any, Any]] = []
    if isinstance(heads, Mapping):
        for layer, hs in heads.items():
            if isinstance(hs, (str, bytes)) or not isinstance(hs, Sequence):
                raise ValueError(f"{where}[{layer!r}] must be a list of head indices, got {hs!r}")
            pairs += [(layer, h) for h in hs]
    elif isinstance(heads, Sequence) and not isinstance(heads, (str, bytes)):
        for i, p in enumerate(heads):
            if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) != 2:
                raise ValueError(f"{where}[{i}] must be a [layer, head] pair, got {p!r}")
            pairs.append((p[0], p[1]))
    else:
        raise ValueError(f"{where} must be {{\"<layer>\": [head, ...]}} or [[layer, head], ...], "
                         f"got {heads!r}")
    out: dict[int, set[int]] = {}
    for layer, h in pairs:
        try:
            L = int(layer)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: layer {layer!r} is not an integer") from None
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)):
            raise ValueError(f"{where}: head {h!r} of layer {L} is not an integer")
        h = int(h)
        if L < 0 or (num_layers is not None and L >= num_layers):
            rng = f"0..{num_layers - 1}" if num_layers is not None else ">= 0"
            raise ValueError(f"{where}: layer {L} is out of range; use a 0-based layer index in {rng}")
        if h < 0 or (num_heads is not None and h >= num_heads):
            rng = f"0..{num_heads - 1}" if num_heads is not None else ">= 0"
            raise ValueError(f"{where}: head {h} of layer {L} is out of range; use a 0-based "
                             f"query-head index in {rng}")
        out.setdefault(L, set()).add(h)
    if not out:
        raise ValueError(f"{where} is empty; name at least one (layer, head)")
    return {L: sorted(hs) for L, hs in sorted(out.items())}


def head_pairs(heads: Mapping[int, Sequence[int]]) -> list[tuple[int, int]]:
    return [(L, h) for L in sorted(heads) for h in heads[L]]


def check_spans(spans: Mapping[str, Any], prompt_len: int, *,
                required: Sequence[str] = ()) -> dict[str, Span]:
    """Half-open `[start, end)` token spans inside the prompt, non-empty and pairwise disjoint."""
    for name in required:
        if name not in spans:
            raise ValueError(f"span {name!r} is missing; pass spans={{{', '.join(map(repr, required))}: "
                             f"(start, end)}} (build_prompt returns them)")
    out: dict[str, Span] = {}
    for name, sp in spans.items():
        try:
            s, e = (int(x) for x in sp)
        except (TypeError, ValueError):
            raise ValueError(f"span {name!r} must be a (start, end) pair of token positions, "
                             f"got {sp!r}") from None
        if s >= e:
            raise ValueError(f"span {name!r} ({s}, {e}) is empty: need start < end (half-open [start, end))")
        if s < 0 or e > prompt_len:
            raise ValueError(f"span {name!r} ({s}, {e}) is out of range for a prompt of {prompt_len} "
                             f"tokens: need 0 <= start < end <= {prompt_len}")
        out[name] = (s, e)
    items = sorted(out.items(), key=lambda kv: kv[1])
    for (n1, (s1, e1)), (n2, (s2, e2)) in zip(items, items[1:]):
        if s2 < e1:
            raise ValueError(f"spans {n1!r} ({s1}, {e1}) and {n2!r} ({s2}, {e2}) overlap; spans must "
                             "be disjoint (half-open [start, end))")
    return out


def _heads_of(results, layer: int, n: int) -> list[int]:
    # Results written before the `heads` field existed hold every head in order.
    got = (getattr(results, "heads", None) or {}).get(ATTN, {}).get(layer)
    return list(range(n)) if got is None else [int(h) for h in got]


def captured_heads(results, site: str = ATTN) -> dict[int, list[int]]:
    """{layer: global head indices} of what `results` holds for `site`."""
    acts = _site(results, site)
    return {L: _heads_of(results, L, t.shape[1]) for L, t in sorted(acts.items())}


def _site(results, site: str) -> dict[int, torch.Tensor]:
    acts = results.activations.get(site)
    if not acts:
        raise ValueError(f"these results hold no {site!r} capture; add {{\"site\": \"{site}\", ...}} to "
                         "the request's capture spec (the analyzer's capture_spec() builds it)")
    return acts


def attention(results, heads: Mapping[int, Sequence[int]], positions: Sequence[int]) -> torch.Tensor:
    """Attention weights `[n_heads, n_positions, P]` (float64) of the (layer, head) pairs of
    `heads`, in `head_pairs` order, for query rows at `positions`."""
    acts = _site(results, ATTN)
    want = [int(p) for p in positions]
    blocks = []
    for L, hs in sorted(heads.items()):
        if L not in acts:
            raise ValueError(f"layer {L} was not captured at 'attn_scores' (captured layers "
                             f"{sorted(acts)}); add it to the capture spec's layers")
        t = acts[L]
        have_heads = _heads_of(results, L, t.shape[1])
        idx = {h: i for i, h in enumerate(have_heads)}
        missing = [h for h in hs if h not in idx]
        if missing:
            raise ValueError(f"heads {missing} of layer {L} were not captured at 'attn_scores' (captured "
                             f"{have_heads}); add them to the capture spec's heads")
        pos = results.positions[ATTN][L].tolist()
        row = {p: i for i, p in enumerate(pos)}
        lost = [p for p in want if p not in row]
        if lost:
            raise ValueError(f"query positions {lost[:8]} were not captured at 'attn_scores' layer {L} "
                             f"(captured {pos[:8]}{'...' if len(pos) > 8 else ''}); set the capture "
                             "spec's tokens to include them")
        sub = t[[row[p] for p in want]][:, [idx[h] for h in hs]]  # [n_pos, n_h, P]
        blocks.append(sub.permute(1, 0, 2).double())
    return torch.cat(blocks, 0)


class AnalyzerConfig(BaseModel):
    """Fields every analyzer config file has. `num_layers`/`num_heads`, when given, are used to
    check head indices."""

    model_config = ConfigDict(extra="forbid")

    analyzer: str
    model: str = ""
    num_layers: int | None = None
    num_heads: int | None = None

    @field_validator("num_layers", "num_heads")
    @classmethod
    def _positive(cls, v):
        if v is not None and v < 1:
            raise ValueError("must be >= 1")
        return v


def relative_to_config(*fields: str):
    """A validator for config fields that name files: a relative path is taken from the config
    file's folder (`load_config` passes it as the context's `base`)."""
    def resolve(cls, v, info: ValidationInfo):
        base = (info.context or {}).get("base")
        if v is not None and base is not None and not os.path.isabs(v):
            return str(Path(base) / v)
        return v
    return field_validator(*fields)(resolve)


def _pydantic_message(err: ValidationError) -> str:
    e = err.errors()[0]
    where = ".".join(str(x) for x in e["loc"]) or "config"
    msg = e["msg"]
    if e["type"] == "extra_forbidden":
        msg = "unknown field; remove it (docs/analyzers.md lists the fields)"
    elif e["type"] == "missing":
        msg = "required field is missing"
    return f"{where}: {msg}"


def load_config(cls: type[AnalyzerConfig], source: Any, name: str) -> Any:
    """A config from a model instance, a dict or a JSON file path; ValueError saying what to fix."""
    if isinstance(source, cls):
        return source
    base: Path | None = None
    where = "config"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        where = f"config file {str(path)!r}"
        if not path.is_file():
            raise ValueError(f"{where} does not exist; pass the path of a JSON config "
                             "(format: docs/analyzers.md)")
        try:
            source = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON ({e.msg} at line {e.lineno})") from None
        base = path.parent
    if not isinstance(source, Mapping):
        raise ValueError(f"{where} must be a JSON object / dict, got {type(source).__name__}")
    data = dict(source)
    data.setdefault("analyzer", name)
    if data["analyzer"] != name:
        raise ValueError(f"{where} is for analyzer {data['analyzer']!r}, not {name!r}")
    try:
        cfg = cls.model_validate(data, context={"base": base})
    except ValidationError as err:
        raise ValueError(f"{where}: {_pydantic_message(err)}") from None
    return cfg


class Analyzer:
    """Base class: `Analyzer(config)` then `analyze(results, ...)` -> a typed result."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[AnalyzerConfig]] = AnalyzerConfig

    def __init__(self, config: Any = None, **fields: Any):
        if config is None or isinstance(config, Mapping):
            # keywords alone (AttentionTracker(important_heads=...)) or over a dict: one check
            cfg = load_config(self.Config, {**(config or {}), **fields}, self.name)
        else:
            cfg = load_config(self.Config, config, self.name)
            if fields:
                cfg = load_config(self.Config, {**cfg.model_dump(), **fields}, self.name)
        self.config = cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Analyzer":
        return cls(Path(path))

    def save_config(self, path: str | os.PathLike) -> str:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        data = self.config.model_dump(mode="json", exclude_none=True)
        # One field per line, values compact (a head table stays readable).
        body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items())
        Path(path).write_text("{\n" + body + "\n}\n")
        return str(path)

    def analyze(self, results, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, results, *args, **kwargs):
        return self.analyze(results, *args, **kwargs)

