"""CoRe / in-context re-ranking: rank N documents in one prompt by the attention the query pays them.

Method: S. Chen, B. J. Gutiérrez, Y. Su, "Attention in Large Language Models Yields Efficient
Zero-Shot Re-Rankers", 2024, arXiv:2410.02642 (ICR); IBM's vLLM-Hook calls its variant, which
restricts the sum to chosen heads, CoRe. Prompt: instruction, the documents, then the query
(the query must come after the documents: causal attention only looks back).

With alpha^{l,h}_{q,j} the attention weight of query-span token q on key j, Q the query span and
H the chosen heads (default: every captured head, as ICR sums all layers and heads):

    s(j)   = sum_{(l,h) in H} (1/|Q|) sum_{q in Q} alpha^{l,h}_{q,j}      (token score)
    S_d    = sum_{j in d} s(j)                                              (uncalibrated)

Calibrated (ICR's default), with s_cal from the same prompt whose query is content-free ("N/A"):

    c(j)   = s(j) - s_cal(j)
    m_d(j) = c(j) > mean_{d}(c) - 2 std_{d}(c)     (ICR's token mask, per document; std unbiased;
                                                    a document with std 0, e.g. one token, keeps all)
    S_d    = sum_{j in d} m_d(j) c(j)

Ranking: documents by S_d, highest first (ties keep input order). `per_head[d, i]` is the same
sum restricted to head i, so each row of per_head sums to S_d.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
from pydantic import Field, ValidationInfo, field_validator

from ._base import ATTN, Analyzer, AnalyzerConfig, Span, attention, captured_heads, check_spans, \
    head_pairs, normalize_heads
from ._registry import register
from .prompt import BuiltPrompt, build_prompt


class CoreRerankerConfig(AnalyzerConfig):
    analyzer: str = "core_reranker"
    heads: dict[int, list[int]] | Literal["all"] = Field(
        default="all", description='{"<layer>": [head, ...]}, or "all" captured heads')
    mask_std: float | None = Field(default=2.0, description="ICR token mask width; null: no mask")
    instruction: str = "Here are some paragraphs:"
    query_instruction: str = ("Please answer the following question based on the information in the "
                              "paragraphs above.")
    calibration_query: str = "N/A"
    chat_template: bool = True

    @field_validator("heads", mode="before")
    @classmethod
    def _heads(cls, v, info: ValidationInfo):
        if v == "all":
            return v
        return normalize_heads(v, where="heads", num_layers=info.data.get("num_layers"),
                               num_heads=info.data.get("num_heads"))


@dataclass(frozen=True)
class RerankPrompt:
    prompt: BuiltPrompt
    doc_spans: list[Span]
    query_span: Span  # the query instruction and query, through the end of the prompt

    @property
    def token_ids(self) -> list[int]:
        return self.prompt.token_ids


@dataclass(frozen=True)
class RerankResult:
    scores: tuple[float, ...]  # S_d per document, input order
    ranking: tuple[int, ...]  # document indices, best first
    heads: tuple[tuple[int, int], ...]
    per_head: np.ndarray = field(repr=False)  # [n_docs, n_heads]
    token_scores: tuple[np.ndarray, ...] = field(repr=False)  # per document: c(j) or s(j), masked
    calibrated: bool = False

    def to_dict(self) -> dict:
        return {"scores": list(self.scores), "ranking": list(self.ranking), "calibrated": self.calibrated,
                "heads": [list(h) for h in self.heads]}


def _token_scores(results, heads, query_span: Span) -> np.ndarray:
    """[n_heads, P]: per head, mean over the query span of the attention on each key."""
    return attention(results, heads, range(*query_span)).mean(1).numpy()


def _check(results, doc_spans, query_span, what: str) -> tuple[list[Span], Span]:
    if not doc_spans:
        raise ValueError("doc_spans is empty; pass one (start, end) span per document")
    named = {f"doc{i}": s for i, s in enumerate(doc_spans)}
    sp = check_spans({**named, "query": query_span}, results.prompt_len)
    q0 = sp["query"][0]
    for name in named:
        if sp[name][1] > q0:
            raise ValueError(f"{what}: span {name!r} {sp[name]} does not end before the query span "
                             f"{sp['query']} starts; put the documents before the query (query tokens "
                             "attend only to earlier tokens)")
    return [sp[n] for n in named], sp["query"]


@register("core_reranker")
class CoreReranker(Analyzer):
    """`CoreReranker(config).analyze(results, doc_spans, query_span, calibration=..., ...)`."""

    Config = CoreRerankerConfig

    def capture_spec(self, query_span: Span) -> dict:
        """The capture item for a prompt whose query span is `query_span` (rows = its tokens)."""
        h = self.config.heads
        tokens = list(range(int(query_span[0]), int(query_span[1])))
        if not tokens:
            raise ValueError(f"query_span {tuple(query_span)} is empty; need start < end")
        if h == "all":
            return {"site": ATTN, "layers": "all", "heads": "all", "tokens": tokens}
        return {"site": ATTN, "layers": sorted(h), "heads": {str(L): hs for L, hs in h.items()},
                "tokens": tokens}

    def prompt(self, tokenizer, query: str, docs: Sequence[str]) -> RerankPrompt:
        """ICR's layout: instruction, "[i] doc" blocks, query instruction, "Query: <query>"."""
        if not docs:
            raise ValueError("docs is empty; pass at least one document")
        c = self.config
        parts: list[tuple] = [(None, c.instruction)]
        for i, d in enumerate(docs):
            parts += [(None, "\n\n"), (f"doc{i}", f"[{i + 1}] {d}")]
        parts += [(None, "\n\n"), ("query", f"{c.query_instruction}\n\nQuery: {query.strip()}")]
        p = build_prompt(tokenizer, parts, chat_template=c.chat_template)
        # As in ICR, the query span runs through the end of the prompt (chat suffix included).
        return RerankPrompt(prompt=p, doc_spans=[p.spans[f"doc{i}"] for i in range(len(docs))],
                            query_span=(p.spans["query"][0], len(p.token_ids)))

    def calibration_prompt(self, tokenizer, docs: Sequence[str]) -> RerankPrompt:
        """The same prompt with the content-free query (ICR: "N/A")."""
        return self.prompt(tokenizer, self.config.calibration_query, docs)

    def analyze(self, results, doc_spans: Sequence[Span], query_span: Span, calibration=None,
                calibration_query_span: Span | None = None) -> RerankResult:
        docs, q = _check(results, doc_spans, query_span, "results")
        heads = captured_heads(results) if self.config.heads == "all" else self.config.heads
        s = _token_scores(results, heads, q)
        if calibration is not None:
            if calibration_query_span is None:
                raise ValueError("calibration results given without calibration_query_span; pass the "
                                 "query span of the calibration prompt")
            _, cq = _check(calibration, docs, calibration_query_span, "calibration")
            for i, (a, b) in enumerate(docs):
                if list(calibration.token_ids[a:b]) != list(results.token_ids[a:b]):
                    raise ValueError(f"document {i} {(a, b)} has different tokens in the calibration "
                                     "prompt; build it with the same documents (calibration_prompt())")
            s_cal = _token_scores(calibration, heads, cq)
        per_head, tok = [], []
        for a, b in docs:
            c = s[:, a:b] if calibration is None else s[:, a:b] - s_cal[:, a:b]  # [n_heads, len]
            total = c.sum(0)
            keep = np.ones_like(total, dtype=bool)
            if calibration is not None and self.config.mask_std is not None:
                sd = total.std(ddof=1) if total.size > 1 else 0.0
                if sd > 0:  # ICR's strict '>' would drop every token of a constant document
                    keep = total > total.mean() - self.config.mask_std * sd
            per_head.append((c * keep).sum(1))
            tok.append(total * keep)
        per_head = np.stack(per_head)
        scores = per_head.sum(1)
        ranking = np.argsort(-scores, kind="stable")
        return RerankResult(scores=tuple(float(x) for x in scores), ranking=tuple(int(i) for i in ranking),
                            heads=tuple(head_pairs(heads)), per_head=per_head, token_scores=tuple(tok),
                            calibrated=calibration is not None)

