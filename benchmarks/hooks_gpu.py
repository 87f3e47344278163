"""Python hooks on the GPU (issue 16): graphs vs eager parity, and their cost beside native.

    source scripts/gpu_env.sh && python3 benchmarks/hooks_gpu.py --out $OUT/hooks

Four engines alive together (`run.py`'s workers): native vLLM with CUDA graphs, native eager,
and vllm-hook with hook layers (the four logit-lens layers and one in the middle) with CUDA
graphs and eager. Parity: a read-only and a modifying hook, graph vs eager, against native's
own graph-vs-eager noise (bf16, random weights). Speed, at each concurrency: decode time per
token (the engine core's step interval) and end-to-end throughput (generate + results, in the
user's hands), alternating engines per rep, for (a) no hooked request, (b) a read-only logit
lens at 4 layers (batched), (c) a modifying hook at 1 layer (batched), and the same as
per-request Python hooks (norms at 4 layers, a scaling at 1). Writes results.json, report.md.

`--hook-graphs-ab`: one more engine, the plugin with `hook_graphs` off (the lens's steady
steps eager, `worker/hook_graphs.py`), timed on the unused and lens workloads in the same
reps; on both, the lens's rows are checked against a reference computed from the same
request's capture (`lens_check`).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from run import (Record, bench_parser, logprob_gap, model_and_base, run_meta, start, torch_cat, tpot,  # noqa: E402
                 tracker_layers)

TARGET_UNUSED, TARGET_HOOKED = 1.01, 1.25


def workloads(L: int) -> dict:
    four, mid = tracker_layers(L), L // 2
    return {
        "unused": None,
        "logit_lens_4_layers": {"hooks": [{"name": "logit_lens", "args": {"layers": four, "k": 5}}]},
        "modify_1_layer": {"hooks": [{"name": "zero_dims", "args": {"layers": [mid], "dims": [0, 1, 2, 3]}}]},
        "py_norms_4_layers": {"pyhooks": [["norms", four]]},
        "py_scale_1_layer": {"pyhooks": [["scale", [mid]]]},
    }


def parity(engines: dict, L: int) -> dict:
    """First-step logprobs and hook outputs, graph vs eager, for a read-only and a modifying
    hook, next to native's graph-vs-eager noise on the same prompts."""
    from safetensors.torch import load_file

    import vllm_hook

    four, mid = tracker_layers(L), L // 2
    specs = [None,
             {"hooks": [{"name": "stream_norms", "args": {"layers": four}}], "capture": [{"layers": four}]},
             {"hooks": [{"name": "zero_dims", "args": {"layers": [mid], "dims": list(range(64))}}],
              "capture": [{"layers": [mid], "tokens": "all"}]},
             {"hooks": [{"name": "logit_lens", "args": {"layers": four, "k": 5}}]}]
    save = tempfile.mkdtemp(prefix="vh_hooks_check_")
    out = {name: w.call({"op": "outputs", "n": len(specs), "prompt_len": 64, "max_tokens": 16, "specs": specs,
                         "save_dir": save, "tag": name, "logprobs": 5})["outputs"]
           for name, w in engines.items()}

    def res(name, i):
        return vllm_hook.Results.load(out[name][i]["saved"])

    g, e = res("plugin_graph", 1), res("plugin_eager", 1)
    norm_err, cap_vs_hook = 0.0, 0.0
    for L_ in four:
        hg = load_norms(g, L_)
        he = load_norms(e, L_)
        norm_err = max(norm_err, float((hg - he).abs().max() / he.abs().max()))
        cap = g.activations["resid_post"][L_].float().norm(dim=-1)
        cap_vs_hook = max(cap_vs_hook, float((hg[:len(cap)] - cap).abs().max() / cap.abs().max()))
    zg, ze = res("plugin_graph", 2), res("plugin_eager", 2)
    zeroed = all(float(r.activations["resid_post"][mid][:, :64].abs().max()) == 0.0 for r in (zg, ze))
    lg, le = res("plugin_graph", 3).hook_results[0], res("plugin_eager", 3).hook_results[0]
    agree = [float((torch_cat(lg[f"layer{x}.ids"])[:, 0] == torch_cat(le[f"layer{x}.ids"])[:, 0]).float().mean())
             for x in four]
    del load_file
    return {
        "noise_native_graph_vs_eager_first_logprob": logprob_gap(out, "native_eager", "native_graph", range(len(specs))),
        "unhooked_plugin_graph_vs_native_graph_first_logprob": logprob_gap(out, "plugin_graph", "native_graph", [0]),
        "read_only_hook_graph_vs_eager_first_logprob": logprob_gap(out, "plugin_eager", "plugin_graph", [1, 3]),
        "modifying_hook_graph_vs_eager_first_logprob": logprob_gap(out, "plugin_eager", "plugin_graph", [2]),
        "modifying_hook_changes_output_first_logprob": logprob_gap(out, "plugin_graph", "native_graph", [2]),
        "read_only_hook_norms_graph_vs_eager_rel": norm_err,
        "read_only_hook_vs_capture_same_engine_rel": cap_vs_hook,
        "modifying_hook_zeroed_dims_exactly": zeroed,
        "logit_lens_top1_agreement_graph_vs_eager": agree,
        "tokens": {k: [o["tokens"] for o in v] for k, v in out.items()},
    }


def lens_check(engines: dict, L: int, model: str) -> dict:
    """The lens's rows against a reference computed here from the same request's capture of
    those layers (the model's dtype), with the checkpoint's final norm and unembedding and
    the same kernels: prompt rows (eager in every engine) and decode rows (on the graph
    engine mostly replayed from the hooks' CUDA graph), for the engine with hook_graphs and
    the one without. Two engines cannot be compared with each other: each compiles its own
    kernels, and bf16 with random weights drifts apart within a few tokens."""
    import json as _json

    import torch
    from safetensors import safe_open

    import vllm_hook
    from vllm_hook.hooks import kernels
    from vllm_hook.hooks.builtin import topk_logprobs

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    four = tracker_layers(L)
    cfg = _json.loads((Path(model) / "config.json").read_text())
    names = ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight")
    w = {}
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt", device=dev) as sf:
            w.update({k: sf.get_tensor(k) for k in names if k in sf.keys()})
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    eps = cfg.get("rms_norm_eps", 1e-6)

    def norm(h):         # vLLM's RMSNorm: fp32 math, rounded to h's dtype, times the weight
        got = kernels.rms_norm(h, w["model.norm.weight"], eps)
        if got is None:
            f = h.float()
            got = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * w["model.norm.weight"]
        return got
    spec = {"hooks": [{"name": "logit_lens", "args": {"layers": four, "k": 5}}],
            "capture": [{"layers": four, "tokens": "all"}], "dtype": "model"}
    save = tempfile.mkdtemp(prefix="vh_lens_check_")
    out = {}
    for name in ("plugin_graph", "plugin_graph_eager_hooks"):
        before = engines[name].call({"op": "stats"})["stats"]["timing"]
        outs = engines[name].call({"op": "outputs", "n": 16, "prompt_len": 64, "max_tokens": 24,
                                   "specs": [spec] * 16, "save_dir": save, "tag": name})["outputs"]
        after = engines[name].call({"op": "stats"})["stats"]["timing"]
        agree = {"prompt": [0, 0], "decode": [0, 0]}
        gap = {"prompt": 0.0, "decode": 0.0}
        for o in outs:
            r = vllm_hook.Results.load(o["saved"])
            for x in four:
                h = r.activations["resid_post"][x].to(dev)
                ids, lps = topk_logprobs(torch.nn.functional.linear(norm(h), head), 5)
                gi = torch_cat(r.hook_results[0][f"layer{x}.ids"]).to(dev)
                gl = torch_cat(r.hook_results[0][f"layer{x}.logprobs"]).to(dev)
                n = min(len(gi), len(ids))
                for part, sl in (("prompt", slice(0, 64)), ("decode", slice(64, n))):
                    agree[part][0] += int((gi[sl, 0] == ids[sl, 0]).sum())
                    agree[part][1] += len(gi[sl])
                    gap[part] = max(gap[part], float((gl[sl, 0] - lps[sl, 0]).abs().max()))
        out[name] = {"top1_equal_prompt": agree["prompt"][0] / max(agree["prompt"][1], 1),
                     "top1_equal_decode": agree["decode"][0] / max(agree["decode"][1], 1),
                     "top1_logprob_gap_prompt": gap["prompt"], "top1_logprob_gap_decode": gap["decode"],
                     "decode_rows": agree["decode"][1],
                     "graph_replays": after.get("graph_replays", 0) - before.get("graph_replays", 0),
                     "graph_captures": after.get("graph_captures", 0) - before.get("graph_captures", 0),
                     "graph_refusals": after.get("graph_refusals", 0) - before.get("graph_refusals", 0)}
    return out


def lens_math(vocab: int) -> dict:
    """The logit lens's top-k/log-probabilities on the GPU, chunked (the built-in) against the
    plain log_softmax + topk, on random bf16 logits: equal top values, the log-probability
    gap, and the time of each (CUDA events, median of 20)."""
    import torch

    from vllm_hook.hooks.builtin import topk_logprobs

    out = {}
    for n in (16, 64, 256):
        z = (torch.randn(n, vocab, device="cuda") * 3).bfloat16()
        (ci, cl), (pi, pl) = topk_logprobs(z, 5), topk_logprobs(z, 5, chunks=1)
        times = {}
        for name, kw in (("chunked", {}), ("plain", {"chunks": 1})):
            ts = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                topk_logprobs(z, 5, **kw)
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            times[name] = statistics.median(ts)
        out[str(n)] = {"top_values_equal": bool(torch.equal(z.gather(1, ci), z.gather(1, pi))),
                       "ids_equal_frac": float((ci == pi).float().mean()),
                       "logprob_max_gap": float((cl - pl).abs().max()),
                       "chunked_us": times["chunked"], "plain_us": times["plain"]}
    return out


def load_norms(r, layer):
    return torch_cat(r.hook_results[0][f"layer{layer}"]).float()


def speed(engines: dict, L: int, args, rows: list, save) -> list[dict]:
    """Appends each rep's row to `rows` and saves: a run cut short keeps the reps it timed."""
    wl = workloads(L)
    native, eager, plugin = engines["native_graph"], engines["native_eager"], engines["plugin_graph"]
    for c in args.concurrency:
        for rep in range(args.reps):
            r = {"concurrency": c, "rep": rep}
            ab = engines.get("plugin_graph_eager_hooks")
            extra = [(f"{k}_eager_hooks", ab, wl[k]) for k in ("unused", "logit_lens_4_layers")] if ab else []
            for name, w, spec in [("native", native, None), ("native_eager", eager, None)] + \
                    [(k, plugin, v) for k, v in wl.items()] + extra:
                if name == "native_eager" and rep >= args.eager_reps:
                    continue
                t = tpot(w, c, args.prompt_len, args.gen, [spec] * c if spec else None, 1)
                r[name] = {"tpot_s": t[t["method"]], "wall_s": t["wall_s"],
                           "tok_per_s": c * (args.gen + 1) / t["wall_s"], "host_us": t["host_us"]}
            rows.append(r)
            save()
            print(f"  c={c:<3} rep {rep}: " + "  ".join(
                f"{k} {1e3 * v['tpot_s']:.2f}ms/{v['tok_per_s']:.0f}t/s" for k, v in r.items()
                if isinstance(v, dict)), flush=True)
    return rows


def report(result: dict) -> str:
    m = result["meta"]
    lines = [f"Run {m['started']}: vLLM {m.get('vllm')}, torch {m.get('torch')}, {m.get('gpu')}; model {m['shape']}; "
             f"prompt {m['prompt_len']} tokens, {m['gen']} generated; wall {m.get('wall_s', 0):.0f} s.", ""]
    st = result["startup"]
    lines += ["| engine | start-up s | CUDA-graph GiB |", "|---|---|---|"]
    lines += [f"| {k} | {v.get('startup_s', float('nan')):.1f} | {v.get('graph_gib', float('nan')):.2f} |"
              for k, v in st.items()]
    lm = result.get("lens_math")
    if lm:
        lines += ["", "Logit-lens top-5 on random bf16 logits (the built-in's chunked path vs plain log_softmax + topk):", "",
                  "| rows | chunked µs | plain µs | top values equal | ids equal | log-prob gap |", "|---|---|---|---|---|---|"]
        lines += [f"| {n} | {v['chunked_us']:.0f} | {v['plain_us']:.0f} | {v['top_values_equal']} | "
                  f"{v['ids_equal_frac']:.3f} | {v['logprob_max_gap']:.2e} |" for n, v in lm.items()]
    ab = result.get("hook_graphs_ab")
    if ab:
        lines += ["", "The lens against a reference from the same request's capture (16 requests x (64 + 24) "
                  "tokens; hook_graphs on, and off in plugin_graph_eager_hooks):", ""] + [f"- {k}: {v}" for k, v in ab.items()]
    p = result.get("parity")
    if p:
        lines += ["", "Parity (graph vs eager, bf16, random weights):", ""]
        lines += [f"- {k}: {v}" for k, v in p.items() if k != "tokens"]
    rows = result.get("speed", [])
    if rows:
        names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
        lines += ["", "Decode time per token (ms) and end-to-end tokens/s, medians over reps; ratio to native:", "",
                  "| requests | workload | TPOT ms | x native | tok/s e2e | x native (time) | target |",
                  "|---|---|---|---|---|---|---|"]
        for c in sorted({r["concurrency"] for r in rows}):
            rs = [r for r in rows if r["concurrency"] == c]
            nt = statistics.median(r["native"]["tpot_s"] for r in rs)
            nw = statistics.median(r["native"]["wall_s"] for r in rs)
            for k in names:
                got = [r[k] for r in rs if k in r]
                t = statistics.median(x["tpot_s"] for x in got)
                w = statistics.median(x["wall_s"] for x in got)
                tps = statistics.median(x["tok_per_s"] for x in got)
                tgt = TARGET_UNUSED if k.startswith("unused") else (TARGET_HOOKED if k not in ("native", "native_eager") else None)
                verdict = "" if tgt is None or c == 1 and k != "unused" else ("met" if t / nt <= tgt and w / nw <= tgt else "NOT met") + f" (<= {tgt})"
                lines.append(f"| {c} | {k} | {1e3 * t:.3f} | {t / nt:.3f} | {tps:.0f} | {w / nw:.3f} | {verdict} |")
        pairs = [(k, "unused") for k in names if k not in ("native", "native_eager", "unused")
                 and not k.endswith("_eager_hooks")]
        pairs += [(k, "unused_eager_hooks") for k in names if k.endswith("_eager_hooks") and k != "unused_eager_hooks"]
        if pairs:
            lines += ["", "In-engine: decode time per token over the same engine's unused rows, median of the "
                      "per-rep ratios [min, max]:", "", "| requests | workload | x unused | reps |", "|---|---|---|---|"]
            for c in sorted({r["concurrency"] for r in rows}):
                rs = [r for r in rows if r["concurrency"] == c]
                for k, base in pairs:
                    q = [r[k]["tpot_s"] / r[base]["tpot_s"] for r in rs if k in r and base in r]
                    if q:
                        lines.append(f"| {c} | {k} | {statistics.median(q):.3f} [{min(q):.3f}, {max(q):.3f}] | {len(q)} |")
    t = (result.get("plugin_stats") or {}).get("timing") or {}
    if t.get("hook_steps"):
        lines += ["", f"Hooked steps of the graph engine: {t['hook_steps']:.0f}, of which "
                  f"{t.get('read_only_steps', 0):.0f} replayed the read-only twin (all hooks read-only); "
                  f"{t.get('hook_calls', 0):.0f} hook calls, {1e6 * t.get('hook_s', 0) / max(t.get('hook_calls', 0), 1):.0f} µs "
                  "of host time each."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--eager-reps", type=int, default=1)
    ap.add_argument("--gpu-mem", type=float, default=0.2)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the script runs")
    ap.add_argument("--hook-graphs-ab", action="store_true",
                    help="a fifth engine with hook_graphs off: its lens timed and its results compared")
    args = ap.parse_args()
    out = Path(args.out)
    model, base = model_and_base(args, max_num_seqs=64)
    if args.smoke:
        args.concurrency, args.gen, args.reps, args.prompt_len = [2], 4, 1, 32
    cfg = json.loads((Path(model) / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    hook_layers = sorted({*tracker_layers(L), L // 2})
    plugin_cfg = {"additional_config": {"vllm_hook": {"hook_layers": hook_layers}}}
    plan = [("native_graph", True, {}), ("plugin_graph", False, plugin_cfg),
            ("native_eager", True, {"enforce_eager": True}),
            ("plugin_eager", False, {**plugin_cfg, "enforce_eager": True})]
    if args.skip_parity:
        plan = plan[:3]            # plugin_eager serves only the parity check
    twins = {}
    if args.smoke:
        # Every --smoke engine is eager already: the eager pair would repeat the graph pair's
        # engines (two more start-ups on the CPU for nothing).
        plan, twins = plan[:2], {"native_eager": "native_graph", "plugin_eager": "plugin_graph"}
    if args.hook_graphs_ab:
        plan.append(("plugin_graph_eager_hooks", False,
                     {"additional_config": {"vllm_hook": {"hook_layers": hook_layers, "hook_graphs": False}}}))
    result = Record(out, run_meta(model, cfg, hook_layers=hook_layers, prompt_len=args.prompt_len, gen=args.gen),
                    render=report, startup={})
    save = result.save

    if not args.smoke:
        result["lens_math"] = lens_math(cfg["vocab_size"])
        print("lens math:", json.dumps(result["lens_math"]), flush=True)
    engines = {}
    try:
        for name, native, extra in plan:
            w, info = start(name, model, {**base, **extra}, out, native=native)
            engines[name] = w
            result["startup"][name] = {k: v for k, v in info.items() if k != "stats"}
            save()
        engines.update({twin: engines[of] for twin, of in twins.items()})
        if not args.skip_parity:
            result["parity"] = parity(engines, L)
            print(json.dumps({k: v for k, v in result["parity"].items() if k != "tokens"}, indent=1), flush=True)
            save()
        if args.hook_graphs_ab:
            try:
                result["hook_graphs_ab"] = lens_check(engines, L, model)
            except Exception as e:          # the timing below still runs
                result["hook_graphs_ab"] = {"error": repr(e)}
            print("hook graphs A/B:", json.dumps(result["hook_graphs_ab"]), flush=True)
            save()
        result["speed"] = []
        speed(engines, L, args, result["speed"], save)
        result["plugin_stats"] = engines["plugin_graph"].call({"op": "stats"})["stats"]
    finally:
        for w in {id(w): w for w in engines.values()}.values():     # a --smoke twin is closed once
            w.close()
        save()
    print(report(result))


if __name__ == "__main__":
    main()
