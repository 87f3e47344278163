"""One heatmap per analyzer, written as a PNG with matplotlib (`pip install vllm-hook[plots]`).

Uses the Agg canvas directly, so it never changes the caller's matplotlib backend.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np


def _figure(w: float, h: float):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - optional dependency
        raise ImportError("plots need matplotlib: pip install 'vllm-hook[plots]'") from None
    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _heatmap(ax, fig, values: np.ndarray, cmap: str, label: str, **kw):
    m = np.ma.masked_invalid(values)
    im = ax.imshow(m, aspect="auto", cmap=cmap, interpolation="nearest", **kw)
    fig.colorbar(im, ax=ax, label=label, fraction=0.046, pad=0.04)
    return im


def _annotate(ax, im, values: np.ndarray, fmt: str = "{:.2f}"):
    if values.size > 400:  # unreadable beyond this
        return
    for (i, j), v in np.ndenumerate(values):
        if np.isfinite(v):
            r, g, b, _ = im.cmap(im.norm(v))
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5  # text colour readable on the cell
            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")


def _outline(ax, cells: Sequence[tuple[int, int]], color: str = "red"):
    from matplotlib.patches import Rectangle

    for r, c in cells:
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=color, linewidth=2))


def _save(fig, path: str | os.PathLike) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(str(path))
    return str(path)


def plot_attention_tracker(result, path: str | os.PathLike, title: str | None = None) -> str:
    """Layers x heads: each captured head's instruction focus a_{l,h}; important heads outlined."""
    v = result.focus_map
    fig = _figure(1.2 + 0.55 * v.shape[1], 1.2 + 0.45 * v.shape[0])
    ax = fig.add_subplot()
    im = _heatmap(ax, fig, v, "viridis", "focus on instruction", vmin=0, vmax=1)
    _annotate(ax, im, v)
    _outline(ax, [(h.layer, h.head) for h in result.per_head])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    verdict = "INJECTED" if result.injected else "benign"
    ax.set_title(title or f"Attention Tracker\nFS={result.focus_score:.3f} "
                          f"(threshold {result.threshold:.3f}): {verdict}", fontsize=9)
    ax.set_xticks(range(v.shape[1]))
    ax.set_yticks(range(v.shape[0]))
    return _save(fig, path)


def plot_head_selection(selection, path: str | os.PathLike, title: str | None = None) -> str:
    """Layers x heads: score (mu_N - k sigma_N) - (mu_A + k sigma_A); selected heads outlined."""
    v = selection.score
    fig = _figure(1.2 + 0.55 * v.shape[1], 1.2 + 0.45 * v.shape[0])
    ax = fig.add_subplot()
    lim = float(np.nanmax(np.abs(v))) or 1.0
    im = _heatmap(ax, fig, v, "RdBu", "selection score", vmin=-lim, vmax=lim)
    _annotate(ax, im, v)
    _outline(ax, [(L, h) for L, hs in selection.heads.items() for h in hs], color="black")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title or f"Important heads (k={selection.k:g})\n"
                          f"{sum(map(len, selection.heads.values()))} selected", fontsize=9)
    ax.set_xticks(range(v.shape[1]))
    ax.set_yticks(range(v.shape[0]))
    return _save(fig, path)


def plot_core_reranker(result, path: str | os.PathLike, doc_labels: Sequence[str] | None = None,
                       title: str | None = None) -> str:
    """Documents x heads: each head's (calibrated) attention mass on each document; the final
    score and rank of each document on the right."""
    v = result.per_head
    n_docs, n_heads = v.shape
    fig = _figure(2.5 + 0.45 * n_heads, 1.4 + 0.45 * n_docs)
    gs = fig.add_gridspec(1, 2, width_ratios=[max(n_heads, 1), max(2, n_heads // 4)])
    ax, bx = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
    lim = float(np.abs(v).max()) or 1.0
    if result.calibrated:
        _heatmap(ax, fig, v, "RdBu", "per-head score", vmin=-lim, vmax=lim)
    else:
        _heatmap(ax, fig, v, "viridis", "per-head score")
    labels = list(doc_labels) if doc_labels else [f"doc {i}" for i in range(n_docs)]
    ax.set_yticks(range(n_docs))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xticks(range(n_heads))
    ax.set_xticklabels([f"{L}.{h}" for L, h in result.heads], rotation=90, fontsize=6)
    ax.set_xlabel("layer.head")
    rank = {d: i for i, d in enumerate(result.ranking)}
    bx.barh(range(n_docs), result.scores, color=["tab:green" if rank[d] == 0 else "tab:gray"
                                                  for d in range(n_docs)])
    bx.set_ylim(n_docs - 0.5, -0.5)
    bx.set_yticks(range(n_docs))
    bx.set_yticklabels([f"#{rank[d] + 1}" for d in range(n_docs)], fontsize=7)
    bx.set_xlabel("score")
    ax.set_title(title or ("CoRe re-ranking" + (" (calibrated)" if result.calibrated else "")), fontsize=9)
    return _save(fig, path)


def plot_hidden_state_probe(result, path: str | os.PathLike, token_labels: Sequence[str] | None = None,
                            title: str | None = None) -> str:
    """Tokens x classes: the probe's probability for each captured row."""
    p = result.probabilities
    p = p[:, None] if p.ndim == 1 else p
    n, C = p.shape
    fig = _figure(2.2 + 0.6 * C, 1.2 + 0.28 * n)
    ax = fig.add_subplot()
    im = _heatmap(ax, fig, p, "magma", "probability", vmin=0, vmax=1)
    _annotate(ax, im, p)
    rows = list(token_labels) if token_labels else [str(x) for x in result.positions.tolist()]
    ax.set_yticks(range(n))
    ax.set_yticklabels(rows, fontsize=7)
    ax.set_ylabel("token" if token_labels else "position")
    names = list(result.labels) if result.labels else None
    ax.set_xticks(range(C))
    cols = names[-C:] if names else (["p(1)"] if C == 1 else [str(c) for c in range(C)])
    ax.set_xticklabels(cols, fontsize=7)
    ax.set_title(title or f"Probe at {result.site} layer {result.layer}", fontsize=9)
    return _save(fig, path)


def plot_layers_by_tokens(values, path: str | os.PathLike, token_labels: Sequence[str] | None = None,
                          title: str = "", label: str = "", cmap: str = "viridis",
                          cell_text: Sequence[Sequence[str]] | None = None,
                          row_labels: Sequence[str] | None = None, ylabel: str = "layer") -> str:
    """A [layers, tokens] heatmap (the hook examples: logit lens, causal tracing, patching);
    `row_labels`/`ylabel` name other rows (the emotion tracker's emotions)."""
    v = np.asarray(values, dtype=float)
    fig = _figure(max(4.0, 0.55 * v.shape[1] + 2), max(2.5, 0.32 * v.shape[0] + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    _heatmap(ax, fig, v, cmap, label)
    ax.set_ylabel(ylabel)
    ax.set_yticks(range(v.shape[0]))
    if row_labels is not None:
        ax.set_yticklabels(list(row_labels), fontsize=7)
    ax.set_xticks(range(v.shape[1]))
    ax.set_xticklabels(list(token_labels) if token_labels is not None else range(v.shape[1]),
                       rotation=60, ha="right", fontsize=7)
    if cell_text is not None:
        for i, row in enumerate(cell_text):
            for j, txt in enumerate(row):
                ax.text(j, i, txt, ha="center", va="center", fontsize=6, color="white")
    ax.set_title(title, fontsize=9)
    return _save(fig, path)
