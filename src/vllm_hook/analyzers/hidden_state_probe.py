"""Linear probe on captured residual-stream vectors.

The standard linear probe of interpretability work (G. Alain, Y. Bengio, "Understanding
intermediate layers using linear classifier probes", 2016, arXiv:1610.01644): a logistic
regression on the hidden state h (one row per captured token) at one layer and site:

    binary (C = 1):  z = w . h + b,        p = sigmoid(z),       prediction = p >= threshold
    C classes:       z = W h + b,          p = softmax(z),       prediction = argmax p

Weights come from a safetensors file (`weight` [C, hidden], `bias` [C], metadata `layer`,
`site`, `labels`) or from `fit_probe`: L2-regularised logistic regression fitted with L-BFGS in
float64, minimising mean cross-entropy + (l2 / 2) ||W||^2 (bias not penalised).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from pydantic import Field
from safetensors import safe_open
from safetensors.torch import save_file

from ._base import Analyzer, AnalyzerConfig, _site, relative_to_config
from ._registry import register


@dataclass(frozen=True)
class LinearProbe:
    weight: torch.Tensor  # [C, hidden], C = 1 for a binary probe
    bias: torch.Tensor  # [C]
    layer: int | None = None
    site: str = "resid_post"
    labels: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.weight.ndim != 2 or self.bias.shape != (self.weight.shape[0],):
            raise ValueError(f"probe weight must be [C, hidden] and bias [C], got {tuple(self.weight.shape)} "
                             f"and {tuple(self.bias.shape)}")

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(x)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"probe expects hidden size {self.hidden_size}, got vectors of size "
                             f"{x.shape[-1]}; use a probe trained on this model's layer")
        return x.double() @ self.weight.double().T + self.bias.double()

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        z = self.logits(x)
        return torch.sigmoid(z[:, 0]) if z.shape[1] == 1 else torch.softmax(z, -1)

    def save(self, path: str | os.PathLike) -> str:
        meta = {"site": self.site, "layer": "" if self.layer is None else str(self.layer),
                "labels": json.dumps(list(self.labels) if self.labels else None)}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.float().contiguous(), "bias": self.bias.float().contiguous()},
                  str(path), metadata=meta)
        return str(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LinearProbe":
        if not Path(path).is_file():
            raise ValueError(f"probe weights file {str(path)!r} does not exist; save one with "
                             "LinearProbe.save() or fit_probe()")
        with safe_open(str(path), "pt") as f:
            names = set(f.keys())
            if not {"weight", "bias"} <= names:
                raise ValueError(f"probe weights file {str(path)!r} must hold tensors 'weight' [C, hidden] "
                                 f"and 'bias' [C], found {sorted(names)}")
            meta = f.metadata() or {}
            w, b = f.get_tensor("weight"), f.get_tensor("bias")
        if w.ndim == 1:  # a bare direction: a binary probe
            w = w[None]
        if b.ndim == 0:
            b = b[None]
        labels = json.loads(meta.get("labels") or "null")
        return cls(weight=w.float(), bias=b.float(), layer=int(meta["layer"]) if meta.get("layer") else None,
                   site=meta.get("site") or "resid_post", labels=tuple(labels) if labels else None)


def fit_probe(x: Any, y: Any, *, l2: float = 1e-3, max_iter: int = 200, layer: int | None = None,
              site: str = "resid_post", labels: Sequence[str] | None = None) -> LinearProbe:
    """Fit a logistic-regression probe on rows `x` [n, hidden] with integer labels `y` in 0..C-1."""
    x = torch.as_tensor(np.asarray(x), dtype=torch.float64)
    y = torch.as_tensor(np.asarray(y)).long()
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"fit_probe needs x [n, hidden] and y [n], got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    classes = int(y.max()) + 1 if y.numel() else 0
    if classes < 2 or int(y.min()) < 0 or len(torch.unique(y)) != classes:
        raise ValueError("labels must be the integers 0..C-1 (C >= 2), each present; got "
                         f"{sorted(set(y.tolist()))}")
    C = 1 if classes == 2 else classes
    w = torch.zeros(C, x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(C, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        z = x @ w.T + b
        if C == 1:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(z[:, 0], y.double())
        else:
            loss = torch.nn.functional.cross_entropy(z, y)
        loss = loss + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return LinearProbe(weight=w.detach().float(), bias=b.detach().float(), layer=layer, site=site,
                       labels=tuple(labels) if labels else None)


def probe_features(results_list: Sequence[Any], layer: int, site: str = "resid_post",
                   position: int | str = "last_prompt") -> torch.Tensor:
    """One row per Results (the token at `position`, or the last prompt token) -> [n, hidden]."""
    rows = []
    for i, r in enumerate(results_list):
        acts = _site(r, site)
        if layer not in acts:
            raise ValueError(f"results[{i}]: layer {layer} was not captured at {site!r} (captured "
                             f"{sorted(acts)}); add it to the capture spec")
        p = r.prompt_len - 1 if position == "last_prompt" else int(position)
        pos = r.positions[site][layer].tolist()
        if p not in pos:
            raise ValueError(f"results[{i}]: position {p} was not captured at {site!r} layer {layer}; "
                             "set the capture spec's tokens to include it")
        rows.append(acts[layer][pos.index(p)].float())
    if not rows:
        raise ValueError("no results given")
    return torch.stack(rows)


class HiddenStateProbeConfig(AnalyzerConfig):
    analyzer: str = "hidden_state_probe"
    layer: int | None = Field(default=None, ge=0, description="0-based layer; default: the weights file's")
    site: str | None = Field(default=None, description="capture site; default: the weights file's")
    weights: str | None = Field(default=None, description="safetensors file (relative: to the config file)")
    threshold: float = 0.5
    labels: list[str] | None = None

    _weights_path = relative_to_config("weights")


@dataclass(frozen=True)
class ProbeResult:
    layer: int
    site: str
    positions: np.ndarray  # [n] token position of each row
    logits: np.ndarray = field(repr=False)  # [n, C]
    probabilities: np.ndarray = field(repr=False)  # [n] (binary) or [n, C]
    predictions: np.ndarray = field(repr=False)  # [n] class index
    labels: tuple[str, ...] | None = None

    def to_dict(self) -> dict:
        return {"layer": self.layer, "site": self.site, "positions": self.positions.tolist(),
                "probabilities": self.probabilities.tolist(), "predictions": self.predictions.tolist(),
                "labels": list(self.labels) if self.labels else None}


@register("hidden_state_probe")
class HiddenStateProbe(Analyzer):
    """`HiddenStateProbe("probe.json")`, or `HiddenStateProbe(probe=fit_probe(...))`."""

    Config = HiddenStateProbeConfig

    def __init__(self, config: Any = None, *, probe: LinearProbe | None = None, **fields: Any):
        if isinstance(config, (str, os.PathLike)) and str(config).endswith(".safetensors"):
            config = {"weights": str(config)}
        super().__init__(config, **fields)
        c = self.config
        if probe is None:
            if c.weights is None:
                raise ValueError("no probe weights: set \"weights\" (a safetensors file) in the config or "
                                 "pass probe=LinearProbe(...) / fit_probe(...)")
            probe = LinearProbe.load(c.weights)
        self.probe = probe
        self.layer = c.layer if c.layer is not None else probe.layer
        if self.layer is None:
            raise ValueError("no layer: set \"layer\" in the config (the weights file does not name one)")
        self.site = c.site or probe.site
        self.labels = tuple(c.labels) if c.labels else probe.labels

    def capture_spec(self, tokens: Any = "last_prompt") -> dict:
        return {"site": self.site, "layers": [self.layer], "tokens": tokens}

    def analyze(self, results, positions: Sequence[int] | None = None) -> ProbeResult:
        acts = _site(results, self.site)
        if self.layer not in acts:
            raise ValueError(f"layer {self.layer} was not captured at {self.site!r} (captured "
                             f"{sorted(acts)}); add it to the capture spec (capture_spec() builds it)")
        x = acts[self.layer]
        pos = results.positions[self.site][self.layer]
        if positions is not None:
            have = {int(p): i for i, p in enumerate(pos.tolist())}
            lost = [int(p) for p in positions if int(p) not in have]
            if lost:
                raise ValueError(f"positions {lost[:8]} were not captured at {self.site!r} layer "
                                 f"{self.layer}; set the capture spec's tokens to include them")
            idx = [have[int(p)] for p in positions]
            x, pos = x[idx], pos[idx]
        z = self.probe.logits(x)
        p = self.probe.probabilities(x)
        pred = (p >= self.config.threshold).long() if z.shape[1] == 1 else p.argmax(-1)
        return ProbeResult(layer=self.layer, site=self.site, positions=pos.numpy().astype(np.int64),
                           logits=z.numpy(), probabilities=p.numpy(), predictions=pred.numpy(),
                           labels=self.labels)
