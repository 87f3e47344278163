"""Emotion tracker: how strongly each token's residual stream points along emotion directions
(after vllm-lens's emotion-tracking demo and the linear-representation work on emotion
concepts, e.g. Zou et al., "Representation Engineering", arXiv 2310.01405).

The method, in our words: for every emotion a handful of example texts that express it; the
feature of a text is the mean residual stream over its tokens after `layer`. An emotion's
direction u_e is the mean feature of its examples minus the mean feature of the contrast set
(the neutral texts when given, else every other emotion's examples), normalised to unit
length; its offset b_e is the mean projection of all fitting examples on u_e. A token's score
for emotion e is h . u_e - b_e: zero is the average example, positive leans towards e.

    d = fit_directions(emotion_features(llm, {"joy": [...], "anger": [...]}, layer=8), layer=8)
    tracker = EmotionTracker(directions=d)
    out = llm.generate([prompt], SamplingParams(max_tokens=32, extra_args={"vllm_hook": {
        "capture": [tracker.capture_spec()]}}))[0]
    trace = tracker.analyze(vllm_hook.results(out))        # scores [tokens, emotions]
    trace.to_html("emotions.html", token_texts)            # the interactive view

The directions mean something only on a trained model and real example texts; on the tiny
random model of the tests they are arbitrary directions, and the tests check only that the
engine computes what Hugging Face computes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from pydantic import Field
from safetensors import safe_open
from safetensors.torch import save_file

from ._base import Analyzer, AnalyzerConfig, _site, relative_to_config
from ._registry import register


@dataclass
class EmotionDirections:
    """Unit directions `[E, hidden]` (float32), one per emotion name, and their offsets `[E]`."""

    names: list[str]
    vectors: torch.Tensor
    offsets: torch.Tensor
    layer: int

    def __post_init__(self):
        if self.vectors.dim() != 2 or self.vectors.shape[0] != len(self.names) or self.offsets.shape != (len(self.names),):
            raise ValueError(f"{len(self.names)} names need vectors [{len(self.names)}, hidden] and offsets "
                             f"[{len(self.names)}], got {tuple(self.vectors.shape)} and {tuple(self.offsets.shape)}")

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """[rows, E] float64: each row's projection on each direction, minus its offset."""
        return h.double() @ self.vectors.double().T - self.offsets.double()

    def save(self, path: str | os.PathLike) -> str:
        save_file({"vectors": self.vectors.float().contiguous(), "offsets": self.offsets.float().contiguous()},
                  str(path), metadata={"names": json.dumps(self.names), "layer": str(self.layer)})
        return str(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EmotionDirections":
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if "names" not in meta or "layer" not in meta:
                raise ValueError(f"{path} is not an emotion directions file (metadata 'names' and 'layer' "
                                 "missing); write one with EmotionDirections.save")
            return cls(json.loads(meta["names"]), f.get_tensor("vectors"), f.get_tensor("offsets"),
                       int(meta["layer"]))


def mean_token_streams(llm, prompts: Sequence[list[int]], layer: int) -> torch.Tensor:
    """[n, hidden] float32: each prompt's residual stream after `layer`, averaged over its tokens."""
    from vllm import SamplingParams

    import vllm_hook

    spec = {"capture": [{"layers": [layer], "tokens": "prompt"}]}
    sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": spec})
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
    return torch.stack([vllm_hook.results(o).activations["resid_post"][layer].double().mean(0)
                        for o in outs]).float()


def emotion_features(llm, examples: Mapping[str, Sequence[list[int]]], layer: int) -> dict[str, torch.Tensor]:
    """{name: [n_name, hidden]}: `mean_token_streams` of each emotion's example prompts (token
    ids), in one generate call."""
    names = list(examples)
    empty = [n for n in names if not len(examples[n])]
    if not names or empty:
        raise ValueError(f"every emotion needs at least one example text (none for {empty or 'any'})")
    flat = [p for n in names for p in examples[n]]
    h = mean_token_streams(llm, flat, layer)
    out, i = {}, 0
    for n in names:
        out[n] = h[i:i + len(examples[n])]
        i += len(examples[n])
    return out


def fit_directions(features: Mapping[str, torch.Tensor], layer: int,
                   neutral: torch.Tensor | None = None) -> EmotionDirections:
    """Directions from per-emotion features `{name: [n, hidden]}` (module docstring); the
    contrast set is `neutral` `[m, hidden]` when given, else the other emotions' examples."""
    names = list(features)
    if len(names) < (1 if neutral is not None else 2):
        raise ValueError("fit_directions needs two emotions, or one emotion and neutral examples")
    feats = {n: torch.as_tensor(features[n]).double() for n in names}
    dims = {f.shape[-1] for f in feats.values()} | ({neutral.shape[-1]} if neutral is not None else set())
    if len(dims) != 1 or any(f.dim() != 2 or not len(f) for f in feats.values()):
        raise ValueError("features must be non-empty [n, hidden] tensors of one hidden size, got "
                         f"{ {n: tuple(f.shape) for n, f in feats.items()} }")
    every = torch.cat([*feats.values(), *([neutral.double()] if neutral is not None else [])])
    vecs = []
    for n in names:
        rest = neutral.double() if neutral is not None else torch.cat([feats[m] for m in names if m != n])
        d = feats[n].mean(0) - rest.mean(0)
        norm = float(d.norm())
        if not norm > 0:
            raise ValueError(f"emotion {n!r}: its examples have the same mean stream as the contrast set; "
                             "give examples that differ")
        vecs.append(d / norm)
    u = torch.stack(vecs)
    return EmotionDirections(names, u.float(), (every @ u.T).mean(0).float(), layer)


@dataclass(frozen=True)
class EmotionTrace:
    """Per-token emotion scores of one request (prompt and generated tokens, in order)."""

    names: list[str]
    positions: np.ndarray                      # [T] token position of each row
    scores: np.ndarray = field(repr=False)     # [T, E] float64
    prompt_len: int = 0

    @property
    def dominant(self) -> list[str]:
        """The emotion of highest score at each token."""
        return [self.names[i] for i in self.scores.argmax(1)]

    def to_dict(self) -> dict:
        return {"names": self.names, "positions": self.positions.tolist(), "scores": self.scores.tolist(),
                "prompt_len": self.prompt_len}

    def to_html(self, path: str | os.PathLike, tokens: Sequence[str], title: str = "Emotion tracker") -> str:
        """A self-contained interactive page (`html.token_view`): `tokens[i]` is the text of
        the token at `positions[i]`."""
        from .html import token_view

        return token_view(path, list(tokens), self.scores, self.names, title=title,
                          boundary=self.prompt_len - int(self.positions[0]) if len(self.positions) else None)

    def plot(self, path: str | os.PathLike, tokens: Sequence[str] | None = None, title: str | None = None) -> str:
        """A PNG heatmap, emotions x tokens."""
        from .plots import plot_layers_by_tokens

        return plot_layers_by_tokens(self.scores.T, path, list(tokens) if tokens is not None else None,
                                     title=title or "emotion score per token", label="score", cmap="coolwarm",
                                     row_labels=self.names, ylabel="emotion")


class EmotionTrackerConfig(AnalyzerConfig):
    analyzer: str = "emotion_tracker"
    directions: str | None = Field(default=None, description="safetensors file of EmotionDirections "
                                                              "(relative: to the config file)")
    tokens: Any = Field(default="all", description="the capture's token selector")

    _directions_path = relative_to_config("directions")


@register("emotion_tracker")
class EmotionTracker(Analyzer):
    """`EmotionTracker("emotions.json")`, or `EmotionTracker(directions=fit_directions(...))`."""

    Config = EmotionTrackerConfig

    def __init__(self, config: Any = None, *, directions: EmotionDirections | None = None, **fields: Any):
        super().__init__(config, **fields)
        if directions is None:
            if self.config.directions is None:
                raise ValueError("no directions: set \"directions\" (a safetensors file) in the config or pass "
                                 "directions=fit_directions(...)")
            directions = EmotionDirections.load(self.config.directions)
        self.directions = directions
        self.layer = directions.layer

    def capture_spec(self) -> dict:
        return {"site": "resid_post", "layers": [self.layer], "tokens": self.config.tokens}

    def analyze(self, results) -> EmotionTrace:
        acts = _site(results, "resid_post")
        if self.layer not in acts:
            raise ValueError(f"layer {self.layer} was not captured at 'resid_post' (captured {sorted(acts)}); "
                             "add it to the capture spec (capture_spec() builds it)")
        x = acts[self.layer]
        if x.shape[-1] != self.directions.vectors.shape[1]:
            raise ValueError(f"the directions have hidden size {self.directions.vectors.shape[1]}, the model "
                             f"{x.shape[-1]}: fit them on this model")
        return EmotionTrace(list(self.directions.names), results.positions["resid_post"][self.layer].numpy()
                            .astype(np.int64), self.directions.scores(x).numpy(), int(results.prompt_len))
