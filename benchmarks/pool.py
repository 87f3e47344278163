"""Pool the decode rows of several run.py results and give each ratio with a bootstrap interval.

One run resolves a few percent only roughly (docs/benchmarks.md: the lent machine's processes
switch between a fast and a slow mode), so the targets are judged on pooled pairs: per workload
and concurrency, the median of the per-rep ratios over every run given, and the 95 % bootstrap
interval of that median. `in-engine` pairs (run.py --in-engine) compare the hooked batch with
the same batch without specs on the same plugin engine; `paired` compares with native's
measurement in its own process, taken next to it.

    python benchmarks/pool.py docs/gpu/run28-in-engine/results.json ... [--out pooled.md]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from report import NULL_CONTROLS, TARGETS

ESTIMATORS = {"in-engine": ("plugin_s", "plugin_unused_s"), "paired": ("plugin_s", "native_s")}


def median_ci(xs: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Median and its 95 % percentile-bootstrap interval."""
    a = np.asarray(xs, dtype=float)
    rng = np.random.default_rng(seed)
    meds = np.median(a[rng.integers(0, len(a), size=(draws, len(a)))], axis=1)
    lo, hi = np.quantile(meds, [0.025, 0.975])
    return float(np.median(a)), float(lo), float(hi)


def pooled_rows(results: list[dict]) -> dict[tuple[str, int], dict[str, list[float]]]:
    """(workload, concurrency) -> estimator -> per-rep ratios over every run given."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for r in results:
        for x in r.get("bench", r).get("tpot", []):
            for name, (num, den) in ESTIMATORS.items():
                if x.get(num) and x.get(den):
                    out[(x["workload"], x["concurrency"])][name].append(x[num] / x[den])
    return out


def _verdict(workload: str, in_engine: list[float] | None) -> str:
    t = TARGETS.get(workload)
    if workload in NULL_CONTROLS and in_engine:
        return "null control (unhooked against unhooked)"
    if t is None or not in_engine:
        return f"<= {t:.2f}" if t else ""
    med, _, hi = median_ci(in_engine)
    return f"<= {t:.2f}: " + ("met, interval too" if hi <= t else "met by the median" if med <= t else "MISSED")


def render(results: list[dict], names: list[str]) -> str:
    rows = pooled_rows(results)
    order = list(dict.fromkeys(w for w, _ in rows))
    lines = [f"Pooled over {', '.join(names)}: median of the per-rep ratios [95 % bootstrap interval].", "",
             "| workload | concurrency | pairs | in-engine | paired (native) | target |", "|---|---|---|---|---|---|"]
    for w, c in sorted(rows, key=lambda k: (order.index(k[0]), k[1])):
        cells = []
        for name in ESTIMATORS:
            xs = rows[(w, c)].get(name)
            cells.append("{:.3f} [{:.3f}, {:.3f}]".format(*median_ci(xs)) if xs else "")
        n = max(len(v) for v in rows[(w, c)].values())
        lines.append(f"| {w} | {c} | {n} | {cells[0]} | {cells[1]} | {_verdict(w, rows[(w, c)].get('in-engine'))} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="run.py results.json files")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args()
    text = render([json.loads(p.read_text()) for p in args.results], [p.parent.name for p in args.results])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
