"""AttnLink-U: attention-based schema linking for text-to-SQL (after Song et al., "AttnLink:
Turning Attention into Schema Links for Text-to-SQL", arXiv 2608.00693, and IBM vLLM-Hook/MIA's
`attnlink` analyzer).

The method, in our words: the prompt lists the database's candidate columns
(`column@table`, one per line) after the question. One attention head that links questions
to schema items reads the prompt from its last token (the generation anchor): the softmax
attention of that query over every prompt key (`attn_scores`, exact, from the paged KV
cache). A candidate's score is the mean weight over its tokens. Candidates are selected
nucleus-style: p = softmax(log(score + 1e-8) / T), the shortest prefix of the ranking whose
cumulative p reaches `top_p` (at least one). Zero-shot: no trained probe, but the (layer,
head) is model-specific (MIA's config for Qwen2.5-Coder-7B-Instruct: layer 22, head 12).

    link = analyzers.get("attnlink")(layer=22, head=12)
    p = link_prompt(tok, question, ["name@singer", "age@singer", ...])
    spec = {"capture": [link.capture_spec()]}
    r = link.analyze(vllm_hook.results(out), p.spans)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from pydantic import Field

from ._base import ATTN, Analyzer, AnalyzerConfig, check_spans
from ._registry import register
from .prompt import BuiltPrompt, build_prompt


def link_prompt(tokenizer, question: str, candidates: Sequence[str], *, chat_template: bool = False,
                instruction: str = "List the columns needed to answer the question.") -> BuiltPrompt:
    """The prompt, with each candidate's exact token span (named by the candidate)."""
    if len(set(candidates)) != len(candidates) or not candidates:
        raise ValueError("candidates must be a non-empty list of distinct `column@table` strings")
    parts: list = [(None, f"{instruction}\nQuestion: {question}\nCandidate Columns:\n")]
    for c in candidates:
        parts += [(c, c), (None, "\n")]
    return build_prompt(tokenizer, parts, chat_template=chat_template)


def select(scores: Sequence[float], temperature: float = 1.0, top_p: float = 0.8) -> tuple[np.ndarray, list[int], list[int]]:
    """(probabilities in input order, ranking, selected indices), in float64."""
    s = np.asarray(scores, dtype=np.float64)
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        raise ValueError("scores must be finite and non-negative")
    if not (np.isfinite(temperature) and temperature > 0) or not 0 < top_p <= 1:
        raise ValueError("temperature must be > 0 and top_p in (0, 1]")
    logit = np.log(s + 1e-8) / temperature
    p = np.exp(logit - logit.max())
    p /= p.sum()
    ranking = sorted(range(len(s)), key=lambda i: (-s[i], i))       # ties keep input order
    cum, selected = 0.0, []
    for i in ranking:
        selected.append(i)
        cum += p[i]
        if cum >= top_p - 1e-12:
            break
    return p, ranking, selected


class AttnLinkConfig(AnalyzerConfig):
    analyzer: str = "attnlink"
    layer: int = Field(ge=0, description="0-based layer of the linking head")
    head: int = Field(ge=0, description="0-based query head")
    temperature: float = Field(default=1.0, gt=0, description="of the column-selection softmax")
    top_p: float = Field(default=0.8, gt=0, le=1, description="cumulative probability to select")


@dataclass(frozen=True)
class AttnLinkResult:
    candidates: list[str]
    scores: np.ndarray             # mean attention over each candidate's tokens, input order
    probabilities: np.ndarray      # input order
    ranking: list[int]
    selected: list[int]

    @property
    def selected_names(self) -> list[str]:
        return [self.candidates[i] for i in self.selected]

    def to_dict(self) -> dict:
        return {"candidates": self.candidates, "scores": self.scores.tolist(),
                "probabilities": self.probabilities.tolist(), "ranking": self.ranking,
                "selected": self.selected_names}


@register("attnlink")
class AttnLink(Analyzer):
    """`AttnLink("attnlink.json")` or `AttnLink(layer=22, head=12)`."""

    Config = AttnLinkConfig

    def capture_spec(self) -> dict:
        c = self.config
        return {"site": ATTN, "layers": [c.layer], "heads": [c.head], "tokens": "last_prompt"}

    def analyze(self, results, spans: Mapping[str, Any], candidates: Sequence[str] | None = None) -> AttnLinkResult:
        """`spans`: each candidate's token span (`link_prompt(...).spans`); `candidates` picks
        and orders them (default: every span, in order)."""
        c = self.config
        acts = results.activations.get(ATTN, {})
        if c.layer not in acts:
            raise ValueError(f"attn_scores of layer {c.layer} were not captured; add capture_spec() to the spec")
        heads = list(results.heads[ATTN][c.layer])
        if c.head not in heads:
            raise ValueError(f"head {c.head} of layer {c.layer} was not captured (got {heads}); use capture_spec()")
        row = acts[c.layer][-1, heads.index(c.head)].double()          # last prompt token -> prompt keys
        names = list(candidates) if candidates is not None else list(spans)
        sp = check_spans({n: spans[n] for n in names}, results.prompt_len, required=names)
        scores = np.array([float(row[a:b].mean()) for a, b in (sp[n] for n in names)])
        p, ranking, selected = select(scores, c.temperature, c.top_p)
        return AttnLinkResult(names, scores, p, ranking, selected)

