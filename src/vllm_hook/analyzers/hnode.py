"""H-Node hallucination probe (after Yocam, Vaidyan and Wang, "H-Node Attack and Defense in
LLMs", arXiv 2603.26045, and IBM vLLM-Hook/MIA's `hnode_hallucination` analyzer).

The method, in our words: prompts "Q: question\\nA: answer" with a correct (grounded, label 0)
or an incorrect (hallucinated, label 1) answer; the feature of a prompt is the residual stream
at its last token. At every layer a logistic regression on standardised features is fitted on a
training split and scored by ROC-AUC on a held-out split; the best layer's probe is kept. Its
H-Nodes are the coordinates with the largest positive weights; each node's baseline is a
percentile of the grounded training activations there. A prompt's score is the probe's
probability of "hallucinated"; the mean excess of its H-Node activations over their baselines
is reported beside it.

    feats = last_token_features(llm, prompts, layers=range(num_layers))
    probe = fit_hnode(feats, labels, eval_mask)
    scores = probe.score(last_token_features(llm, new_prompts, [probe.layer])[probe.layer])

Meaningful only on a trained model (MIA ships a probe for Qwen2.5-1.5B-Instruct at layer 14,
fitted on 300 TruthfulQA questions); on random weights it separates whatever tokens differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .hidden_state_probe import fit_probe


def last_token_features(llm, prompts: Sequence[list[int]], layers: Iterable[int]) -> dict[int, torch.Tensor]:
    """{layer: [n, hidden] float32}: the residual stream after each layer at each prompt's
    last token, from one capture of all the layers."""
    from vllm import SamplingParams

    import vllm_hook

    layers = sorted(set(layers))
    sp = SamplingParams(max_tokens=1, temperature=0.0,
                        extra_args={"vllm_hook": {"capture": [{"layers": layers, "tokens": "last_prompt"}]}})
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
    res = [vllm_hook.results(o).activations["resid_post"] for o in outs]
    return {L: torch.stack([r[L][-1] for r in res]).float() for L in layers}


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of `scores` for labels 1 against 0 (ties count half)."""
    s, y = torch.as_tensor(scores).double(), torch.as_tensor(labels).bool()
    pos, neg = s[y], s[~y]
    if not len(pos) or not len(neg):
        raise ValueError("AUC needs both labels in the evaluation split")
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())


@dataclass
class HNodeScores:
    probabilities: torch.Tensor     # P(hallucinated), [n]
    margins: torch.Tensor           # the logit z, [n]
    h_node_excess: torch.Tensor     # mean over H-Nodes of max(0, h - baseline), [n]
    verdicts: list[str]


@dataclass
class HNodeProbe:
    layer: int
    weight: torch.Tensor            # [hidden], on standardised features
    bias: float
    mean: torch.Tensor              # [hidden] standardisation
    scale: torch.Tensor             # [hidden]
    nodes: torch.Tensor             # [N] coordinates, largest positive weight first
    baselines: torch.Tensor         # [N] percentile of grounded activations
    threshold: float = 0.5
    auc_per_layer: dict[int, float] = field(default_factory=dict)

    def score(self, h: torch.Tensor) -> HNodeScores:
        h = torch.as_tensor(h).double()
        if h.dim() != 2 or h.shape[1] != self.weight.shape[0]:
            raise ValueError(f"expected [n, {self.weight.shape[0]}] features of layer {self.layer}, "
                             f"got {tuple(h.shape)}")
        z = ((h - self.mean.double()) / self.scale.double()) @ self.weight.double() + self.bias
        p = torch.sigmoid(z)
        excess = (h[:, self.nodes] - self.baselines.double()).clamp_min(0).mean(1)
        return HNodeScores(p, z, excess, ["hallucinated" if x >= self.threshold else "grounded" for x in p.tolist()])

    def save(self, path: str | Path) -> None:
        meta = {"layer": str(self.layer), "bias": repr(self.bias), "threshold": repr(self.threshold),
                "auc_per_layer": json.dumps({str(k): v for k, v in self.auc_per_layer.items()})}
        save_file({"weight": self.weight.float().contiguous(), "mean": self.mean.float().contiguous(),
                   "scale": self.scale.float().contiguous(), "nodes": self.nodes.long().contiguous(),
                   "baselines": self.baselines.float().contiguous()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "HNodeProbe":
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}
        return cls(int(meta["layer"]), t["weight"], float(meta["bias"]), t["mean"], t["scale"], t["nodes"],
                   t["baselines"], float(meta.get("threshold", 0.5)),
                   {int(k): v for k, v in json.loads(meta.get("auc_per_layer") or "{}").items()})


def fit_hnode(features: dict[int, torch.Tensor], labels: Sequence[int], eval_mask: Sequence[bool], *,
              n_nodes: int = 50, percentile: float = 80.0, C: float = 1.0, threshold: float = 0.5) -> HNodeProbe:
    """Fit per layer on the rows not in `eval_mask`, keep the layer of best held-out AUC.

    The regression is L2-regularised logistic regression with inverse strength C on the sum of
    per-example losses (scikit-learn's convention), on features standardised with the training
    rows' mean and standard deviation (a zero deviation counts as 1)."""
    y = torch.as_tensor(list(labels)).long()
    ev = torch.as_tensor(list(eval_mask)).bool()
    if not features or any(x.shape[0] != len(y) for x in features.values()) or len(ev) != len(y):
        raise ValueError("every layer's features, the labels and eval_mask need one row per prompt")
    tr = ~ev
    if not 0 < n_nodes or not 0 <= percentile <= 100:
        raise ValueError("n_nodes must be positive and percentile in 0..100")
    best = None
    aucs: dict[int, float] = {}
    for L, x in sorted(features.items()):
        x = x.double()
        mu = x[tr].mean(0)
        sd = x[tr].std(0, unbiased=False)
        sd = torch.where(sd > 0, sd, torch.ones_like(sd))
        z = (x - mu) / sd
        probe = fit_probe(z[tr], y[tr], l2=1.0 / (C * int(tr.sum())), max_iter=500, layer=L)
        aucs[L] = roc_auc(probe.logits(z[ev])[:, 0], y[ev])
        if best is None or aucs[L] > aucs[best[0]]:
            best = (L, probe, mu, sd)
    L, probe, mu, sd = best
    w = probe.weight[0].double()
    k = min(n_nodes, w.numel())
    nodes = torch.argsort(w, descending=True)[:k]
    grounded = features[L].double()[tr & (y == 0)]
    if not len(grounded):
        raise ValueError("the training split has no grounded (label 0) prompt for the baselines")
    base = torch.quantile(grounded[:, nodes], percentile / 100.0, dim=0)
    return HNodeProbe(L, w.float(), float(probe.bias[0]), mu.float(), sd.float(), nodes, base.float(),
                      threshold, aucs)
