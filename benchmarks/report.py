"""Render results.json of run.py as a markdown report (the tables of docs/benchmarks.md)."""

from __future__ import annotations

import json
import statistics
import sys

TARGETS = {  # issue 5: ratio to native TPOT, same run, CUDA graphs on
    "unused": 1.01, "steer_add_1_layer": 1.02, "steer_add_all_layers": 1.05,
    "capture_last_prompt_4_layers": 1.03, "mixed_thirds": 1.05,
}

# Workloads whose in-engine pair times the same unhooked batch twice (the estimator's null control).
NULL_CONTROLS = {"unused", "unused_full_engine", "unused_capture_only_engine"}


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def _p10(xs):
    return statistics.quantiles(xs, n=10, method="inclusive")[0] if len(xs) > 1 else (xs or [float("nan")])[0]


def write_report(r: dict) -> str:
    m = r["meta"]
    lines = [f"Run {m.get('started')}: vLLM {m.get('vllm')}, torch {m.get('torch')}, {m.get('gpu')}; "
             f"model {m['shape']}; suite `{m['suite']}`; wall {m.get('wall_s', 0):.0f} s.", ""]
    st = r.get("startup", {})
    if st:
        lines += ["| engine | start-up s | compile s | CUDA-graph GiB | KV cache tokens |", "|---|---|---|---|---|"]
        for k, v in st.items():
            lines.append(f"| {k} | {v.get('startup_s', float('nan')):.1f} | {v.get('compile_s', float('nan')):.1f} | "
                         f"{v.get('graph_gib', float('nan')):.2f} | {int(v.get('kv_tokens', 0)):,} |")
        lines.append("")
    b = r.get("bench")
    if b:
        if b["tpot"]:
            methods = {x.get("method", "wall_difference") for x in b["tpot"]}
            how = {"step": "the median interval between the engine core's decode steps (its own "
                           "per-step output timestamps)",
                   "timestamps": "from vLLM's per-request token timestamps, (last - first) / (tokens - 1) "
                                 "per request, mean over the batch",
                   "engine_timestamps": "from vLLM's per-request token timestamps"}.get(
                methods.pop() if len(methods) == 1 else "", "(W(gen+1) - W(1)) / gen")
            lines += [f"Decode time per output token, {how}. Native is the median of every "
                      "native measurement at that concurrency (taken alternately with the plugin's, "
                      "throughout the run); plugin the median of its reps; `paired` is the median of "
                      "plugin/native over the adjacent pairs; `min` is the plugin's fastest rep over "
                      "native's fastest of the measurements paired with them (host noise only ever adds time); "
                      "`floor` is the plugin's 10th-percentile rep over native's 10th percentile at that "
                      "concurrency (the machine's fast mode against its fast mode); "
                      "`in-engine` (with `--in-engine`) is the median of the plugin's rep over the same batch without "
                      "specs timed next to it on the same plugin engine, order alternating (one process: both share its speed mode); "
                      "`ts` is the median ratio by vLLM's per-request token timestamps, for comparison; `host µs` "
                      "the plugin's own host time per hooked step (worker, `vllm_hook.stats` timing), median, "
                      "admissions and prefills included; `tok/s` the decode throughput, concurrency / TPOT; `repeat µs` the same per steady decode step (one "
                      "that repeated the last step's routing); `target` judges `in-engine` where it was measured, else "
                      "`ratio` (docs/benchmarks.md judges several runs pooled: benchmarks/pool.py). "
                      + _spread(b["tpot"]), "",
                      "| workload | engine | concurrency | native ms | plugin ms | native tok/s | plugin tok/s "
                      "| ratio | paired | min | floor | in-engine | ts | host µs | repeat µs | target |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            order = list(dict.fromkeys(x["workload"] for x in b["tpot"]))
            keys = sorted({(x["workload"], x["concurrency"]) for x in b["tpot"]}, key=lambda k: (order.index(k[0]), k[1]))
            for w, c in keys:
                rows = [x for x in b["tpot"] if x["workload"] == w and x["concurrency"] == c]
                n = _med([x["native_s"] for x in b["tpot"] if x["concurrency"] == c])
                p = _med([x["plugin_s"] for x in rows])
                paired = _med([x["plugin_s"] / x["native_s"] for x in rows])
                mn = min(x["plugin_s"] for x in rows) / min(x["native_s"] for x in rows)
                ts = [x["plugin_ts_s"] / x["native_ts_s"] for x in rows if "native_ts_s" in x]
                ts = f"{_med(ts):.3f}" if ts else ""
                ie_r = [x["plugin_s"] / x["plugin_unused_s"] for x in rows if x.get("plugin_unused_s")]
                ie = f"{_med(ie_r):.3f}" if ie_r else ""
                floor = _p10([x["plugin_s"] for x in rows]) / _p10([x["native_s"] for x in b["tpot"] if x["concurrency"] == c])
                hu, ru = ([x[k] for x in rows if x.get(k) is not None]
                          for k in ("plugin_step_host_us", "plugin_repeat_host_us"))
                hu, ru = (f"{_med(v):.0f}" if v else "" for v in (hu, ru))
                t = TARGETS.get(w)
                # For `unused` both in-engine measurements are unhooked: a null control, not a verdict.
                judged = _med(ie_r) if ie_r and w not in NULL_CONTROLS else p / n
                verdict = "" if t is None else (f"<= {t:.2f} {'met' if judged <= t else 'MISSED'}")
                lines.append(f"| {w} | {rows[0].get('engine', 'plugin')} | {c} | {1e3 * n:.3f} | {1e3 * p:.3f} | "
                             f"{c / n:,.0f} | {c / p:,.0f} | {p / n:.3f} | {paired:.3f} | {mn:.3f} | {floor:.3f} | {ie} | {ts} | {hu} | {ru} | {verdict} |")
        if b["prefill"]:
            lines += ["", "Prefill latency (one request, max_tokens=1, wall time of generate + results):", "",
                      "| prompt tokens | workload | native ms | plugin ms | ratio | captured MiB |", "|---|---|---|---|---|---|"]
            for x in b["prefill"]:
                lines.append(f"| {x['prompt_len']} | {x['workload']} | {1e3 * x['native_s']:.2f} | "
                             f"{1e3 * x['plugin_s']:.2f} | {x['plugin_s'] / x['native_s']:.2f} | "
                             f"{x['capture_bytes'] / 2**20:.2f} |")
        if b["capture_e2e"]:
            lines += ["", "A 512-token prompt with captures delivered to host memory (end-to-end request "
                      "latency; target for all-layer all-token capture <= 2x native):", "",
                      "| workload | generated tokens | native ms | plugin ms | ratio | min | captured MiB | capture MiB/s |",
                      "|---|---|---|---|---|---|---|---|"]
            for x in b["capture_e2e"]:
                mn = (f"{min(x['plugin_times']) / min(x['native_times']):.2f}"
                      if x.get("native_times") else "")
                lines.append(f"| {x.get('workload', 'capture_all_tokens_all_layers')} | {x['max_tokens']} | "
                             f"{1e3 * x['native_s']:.1f} | {1e3 * x['plugin_s']:.1f} | "
                             f"{x['plugin_s'] / x['native_s']:.2f} | {mn} | {x['capture_bytes'] / 2**20:.1f} | "
                             f"{x['capture_bytes'] / 2**20 / x['plugin_s']:.0f} |")
        staged = [x for x in b["capture_e2e"] if x.get("stages_ms")]
        if staged:
            names = list(staged[0]["stages_ms"])
            lines += ["", "Delivery stages, mean ms per request (`vllm_hook.stats` timing; the frontend's "
                      "fetch RPC contains the worker's fetch, which contains its write):", "",
                      "| workload | generated tokens | " + " | ".join(names) + " |",
                      "|---|---|" + "---|" * len(names)]
            for x in staged:
                lines.append(f"| {x['workload']} | {x['max_tokens']} | "
                             + " | ".join(f"{x['stages_ms'][k]:.1f}" for k in names) + " |")
        s, f = b.get("plugin_stats", {}), b.get("plugin_full_stats", {})
        lines += ["", f"Plugin device buffers: {s.get('device_buffer_bytes', 0) / 2**20:.1f} MiB (lean), "
                  f"{f.get('device_buffer_bytes', 0) / 2**20:.1f} MiB (full)."]
    c = r.get("check")
    if c:
        lines += ["Checks:", "", "```", json.dumps(c["checks"], indent=1), "```"]
        if "checks_breakable" in c:
            lines += ["", "Checks, breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1) against the same eager "
                      "engines:", "", "```", json.dumps(c["checks_breakable"], indent=1), "```"]
    return "\n".join(lines) + "\n"



def _spread(tpot: list[dict]) -> str:
    """How much native's own measurements varied: the noise any ratio carries."""
    parts = []
    for c in sorted({x["concurrency"] for x in tpot}):
        n = sorted(1e3 * x["native_s"] for x in tpot if x["concurrency"] == c)
        parts.append(f"c={c}: {n[0]:.3f} to {n[-1]:.3f} ms ({len(n)})")
    return "Native's measurements ranged " + "; ".join(parts) + "."


if __name__ == "__main__":
    print(write_report(json.load(open(sys.argv[1]))))
