"""Attention Tracker: prompt-injection detection from where a few heads look.

Method: K.-H. Hung, C.-Y. Ko, A. Rawat, I-H. Chung, W. H. Hsu, P.-Y. Chen, "Attention Tracker:
Detecting Prompt Injection Attacks in LLMs", 2024, arXiv:2411.00348. An injected instruction
in the data distracts some "important heads" from the original instruction.

With alpha^{l,h}_j the attention weight of the last prompt token (position P-1) on key j,
I the instruction span and D the data span:

    a_{l,h}  = sum_{j in I} alpha^{l,h}_j / (sum_{j in I} alpha^{l,h}_j + sum_{j in D} alpha^{l,h}_j + eps)
    FS       = mean_{(l,h) in H} a_{l,h}                     (focus score, eps = 1e-8)
    injected = FS <= threshold

The per-head share is normalised by the instruction + data attention, as the authors' code
does ("normalize_sum"), so attention sinks outside both spans do not count.

Important heads (`find_important_heads`), from labelled benign (N) and injected (A) prompts:

    score_{l,h} = (mu_N - k sigma_N) - (mu_A + k sigma_A)        of a_{l,h} over each set
    H           = {(l,h) : score_{l,h} > 0}

(sigma: population std). The paper's rule; k (default 1) trades how many heads pass against
how cleanly they separate. The threshold we suggest is the midpoint of the mean FS of the two
sets over H (the paper leaves the threshold to the user; its code defaults to 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from pydantic import Field, ValidationInfo, field_validator, model_validator

from ._registry import register
from ._base import ATTN, Analyzer, AnalyzerConfig, attention, captured_heads, check_spans, head_pairs, \
    normalize_heads
from .prompt import BuiltPrompt, build_prompt

EPS = 1e-8
SPANS = ("instruction", "data")


class AttentionTrackerConfig(AnalyzerConfig):
    analyzer: str = "attention_tracker"
    important_heads: dict[int, list[int]] = Field(
        description='{"<layer>": [head, ...]} (or [[layer, head], ...]): the heads averaged into FS')
    threshold: float = 0.5
    instruction: str | None = Field(default=None, description="default instruction text for prompt()")
    chat_template: bool = True
    instruction_role: str = "system"
    data_role: str = "user"
    spans: dict[str, tuple[int, int]] | None = Field(
        default=None, description="fixed spans, for prompts whose layout never changes")

    @field_validator("important_heads", mode="before")
    @classmethod
    def _heads(cls, v, info: ValidationInfo):
        return normalize_heads(v, where="important_heads", num_layers=info.data.get("num_layers"),
                               num_heads=info.data.get("num_heads"))

    @model_validator(mode="after")
    def _spans(self):
        if self.spans is not None:
            unknown = set(self.spans) - set(SPANS)
            if unknown:
                raise ValueError(f"spans may name only {SPANS}, got {sorted(unknown)}")
        return self


@dataclass(frozen=True)
class HeadFocus:
    layer: int
    head: int
    instruction: float  # sum of attention on the instruction span
    data: float  # sum of attention on the data span
    focus: float  # instruction / (instruction + data + eps)


@dataclass(frozen=True)
class AttentionTrackerResult:
    focus_score: float
    threshold: float
    injected: bool
    per_head: tuple[HeadFocus, ...]  # the important heads, in (layer, head) order
    query_position: int
    spans: dict[str, tuple[int, int]]
    # a_{l,h} of every captured head, [max layer + 1, max head + 1], NaN where not captured.
    focus_map: np.ndarray = field(repr=False)

    def to_dict(self) -> dict:
        return {"focus_score": self.focus_score, "threshold": self.threshold, "injected": self.injected,
                "query_position": self.query_position, "spans": self.spans,
                "per_head": [vars(h) for h in self.per_head]}


def _focus(w: np.ndarray, spans: Mapping[str, tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    (i0, i1), (d0, d1) = spans["instruction"], spans["data"]
    inst = w[..., i0:i1].sum(-1)
    data = w[..., d0:d1].sum(-1)
    return inst, data, inst / (inst + data + EPS)


def focus_map(results, spans: Mapping[str, Any], heads: Mapping[int, Sequence[int]] | None = None,
              position: int | None = None) -> np.ndarray:
    """a_{l,h} of `heads` (default: every captured head) as a [layers, heads] array (NaN = not captured)."""
    P = results.prompt_len
    sp = check_spans(spans, P, required=SPANS)
    heads = captured_heads(results) if heads is None else heads
    q = P - 1 if position is None else position
    w = attention(results, heads, [q])[:, 0].numpy()  # [n_heads, P]
    _, _, a = _focus(w, sp)
    pairs = head_pairs(heads)
    out = np.full((max(L for L, _ in pairs) + 1, max(h for _, h in pairs) + 1), np.nan)
    for (L, h), v in zip(pairs, a):
        out[L, h] = v
    return out


@register("attention_tracker")
class AttentionTracker(Analyzer):
    """`AttentionTracker("configs/qwen2.json").analyze(results, spans)`."""

    Config = AttentionTrackerConfig

    def capture_spec(self, all_heads: bool = False) -> dict:
        """The capture item this analyzer needs (add it to the request's `capture` list).
        `all_heads=True` captures every head, for a full focus map or `find_important_heads`."""
        if all_heads:
            return {"site": ATTN, "layers": "all", "heads": "all", "tokens": "last_prompt"}
        h = self.config.important_heads
        return {"site": ATTN, "layers": sorted(h), "heads": {str(L): hs for L, hs in h.items()},
                "tokens": "last_prompt"}

    def prompt(self, tokenizer, data: str, instruction: str | None = None) -> BuiltPrompt:
        """The prompt (instruction, then data) with exact spans, per this config's layout."""
        instruction = instruction if instruction is not None else self.config.instruction
        if instruction is None:
            raise ValueError("no instruction text: pass instruction=... or set \"instruction\" in the config")
        c = self.config
        return build_prompt(tokenizer, [("instruction", instruction, c.instruction_role),
                                        ("data", data, c.data_role)], chat_template=c.chat_template)

    def analyze(self, results, spans: Mapping[str, Any] | None = None) -> AttentionTrackerResult:
        spans = spans if spans is not None else self.config.spans
        if spans is None:
            raise ValueError("no spans: pass spans={'instruction': (s, e), 'data': (s, e)} (prompt() or "
                             "build_prompt() returns them) or set \"spans\" in the config")
        sp = check_spans(spans, results.prompt_len, required=SPANS)
        sp = {k: sp[k] for k in SPANS}
        q = results.prompt_len - 1
        heads = self.config.important_heads
        w = attention(results, heads, [q])[:, 0].numpy()
        inst, data, a = _focus(w, sp)
        per = tuple(HeadFocus(L, h, float(i), float(d), float(f))
                    for (L, h), i, d, f in zip(head_pairs(heads), inst, data, a))
        fs = float(a.mean())
        return AttentionTrackerResult(focus_score=fs, threshold=self.config.threshold,
                                      injected=bool(fs <= self.config.threshold), per_head=per,
                                      query_position=q, spans=sp, focus_map=focus_map(results, sp))


@dataclass(frozen=True)
class HeadSelection:
    heads: dict[int, list[int]]
    score: np.ndarray = field(repr=False)  # [layers, heads] score_{l,h}; NaN where not captured
    mean_benign: np.ndarray = field(repr=False)
    std_benign: np.ndarray = field(repr=False)
    mean_injected: np.ndarray = field(repr=False)
    std_injected: np.ndarray = field(repr=False)
    k: float
    threshold: float  # midpoint of the mean FS of benign and injected examples over `heads`
    fs_benign: tuple[float, ...]
    fs_injected: tuple[float, ...]

    def config(self, **fields: Any) -> AttentionTrackerConfig:
        """An AttentionTracker config with these heads and threshold (plus `fields`)."""
        L, H = self.score.shape
        data = {"num_layers": L, "num_heads": H, "threshold": self.threshold,
                "important_heads": {str(k): v for k, v in self.heads.items()}, **fields}
        return AttentionTrackerConfig.model_validate(data)


Example = Any  # (Results, spans) or a precomputed [layers, heads] focus map


def _maps(examples: Sequence[Example], what: str) -> np.ndarray:
    if not examples:
        raise ValueError(f"no {what} examples; find_important_heads needs at least one of each label")
    maps = []
    for i, ex in enumerate(examples):
        if isinstance(ex, np.ndarray):
            maps.append(ex.astype(np.float64))
        elif isinstance(ex, (tuple, list)) and len(ex) == 2:
            maps.append(focus_map(ex[0], ex[1]))
        else:
            raise ValueError(f"{what}[{i}] must be (Results, spans) or a [layers, heads] focus map")
    shapes = {m.shape for m in maps}
    if len(shapes) != 1:
        raise ValueError(f"{what} examples have different captured layers/heads {sorted(shapes)}; capture "
                         "the same heads (capture_spec(all_heads=True)) for every example")
    return np.stack(maps)


def find_important_heads(benign: Sequence[Example], injected: Sequence[Example], k: float = 1.0,
                         max_heads: int | None = None, min_heads: int = 0) -> HeadSelection:
    """Heads whose instruction focus separates benign from injected prompts (rule: module doc).

    `max_heads` keeps only the best-scoring heads; `min_heads` takes the best heads even when
    fewer pass the rule (e.g. for a model where none does); if none is selected, ValueError."""
    N, A = _maps(benign, "benign"), _maps(injected, "injected")
    if N.shape[1:] != A.shape[1:]:
        raise ValueError(f"benign and injected examples captured different heads ({N.shape[1:]} vs "
                         f"{A.shape[1:]}); capture the same heads for all")
    mu_n, sd_n, mu_a, sd_a = N.mean(0), N.std(0), A.mean(0), A.std(0)
    score = (mu_n - k * sd_n) - (mu_a + k * sd_a)
    flat = np.where(np.isnan(score), -np.inf, score).ravel()
    order = np.argsort(-flat, kind="stable")
    chosen = [int(i) for i in order if flat[i] > 0]
    if len(chosen) < min_heads:
        chosen = [int(i) for i in order[:min_heads] if np.isfinite(flat[i])]
    if max_heads is not None:
        chosen = chosen[:max_heads]
    if not chosen:
        raise ValueError(f"no head has score > 0 with k={k}; lower k, add labelled prompts, or pass "
                         "min_heads to take the best heads anyway")
    H = score.shape[1]
    heads: dict[int, list[int]] = {}
    for i in sorted(chosen):
        heads.setdefault(i // H, []).append(i % H)
    pairs = head_pairs(heads)
    fs = lambda M: tuple(float(np.mean([m[L, h] for L, h in pairs])) for m in M)  # noqa: E731
    fs_n, fs_a = fs(N), fs(A)
    thr = float((np.mean(fs_n) + np.mean(fs_a)) / 2)
    return HeadSelection(heads=heads, score=score, mean_benign=mu_n, std_benign=sd_n, mean_injected=mu_a,
                         std_injected=sd_a, k=k, threshold=thr, fs_benign=fs_n, fs_injected=fs_a)
