"""End-to-end throughput at the batch sizes users run (issue 17): native and vllm-hook, one run.

    source scripts/gpu_env.sh && python3 benchmarks/throughput.py --out $OUT/tp        # H200
    python benchmarks/throughput.py --smoke --out /tmp/tp                              # CPU, tiny

Timed from `llm.generate` to every output's `vllm_hook.results()` in the user's hands: 64 and
256 requests, prefill only (1 generated token) and 128 generated, and 32 x 512-token prompts
captured at every layer and token (results in float32, and in the model's dtype). Each rep times
native (its own process), the plugin engine without specs and the plugin engine with the
workload's specs, the plugin pair in alternating order (the in-engine ratio: hooked over
unhooked on one engine). Reports medians with 95 % bootstrap intervals and the plugin's host
time per request by stage, from its counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from pool import median_ci  # noqa: E402
from run import Record, bench_parser, host_line, model_and_base, run_meta, start, workloads  # noqa: E402

BIG = ("capture_all_tokens_all_layers", "capture_all_tokens_all_layers_model_dtype")
TARGETS = {("steer_add_all_layers", False): 1.03, ("steer_add_all_layers_own_scale", False): 1.03,
           ("steer_add_all_layers_8_scales", False): 1.03, ("capture_last_prompt_4_layers", False): 1.03,
           ("mixed_thirds", False): 1.05, ("mixed_thirds_model_dtype", False): 1.05, ("prefill", True): 1.10, **{(b, False): 1.5 for b in BIG}}
STAGES = {  # counter (frontend or worker timing) -> stage name
    "frontend.admit_s": "admission (parse, resolve)", "worker.events_s": "worker admit/finish",
    "worker.step_host_s": "routing (per step)", "worker.drain_s": "of which stored (hand-over)",
    "worker.repeated_s": "of which repeated steps",
    "worker.wait_staging_s": "of which waiting for the device",
    "worker.prepare_s": "of which fetch replies made ahead", "worker.write_s": "worker write",
    "worker.fetch_s": "worker fetch (incl. write)", "worker.wait_copies_s": "of which waiting for copies",
    "frontend.fetch_rpc_s": "fetch RPC (incl. worker write)",
    "frontend.rpc_to_worker_s": "of which to the worker", "frontend.rpc_back_s": "of which back",
    "frontend.read_s": "frontend read",
    "frontend.build_s": "Results build"}


ONE_PARAMS = {"on": False}       # --one-params
VARIED = {"on": False}           # --varied-lengths
LATE = {"on": False}             # --late-fetch


def timed(w, n, plen, gen, specs, seed, late=False):
    r = w.call({"op": "time", "n": n, "prompt_len": plen, "max_tokens": gen, "specs": specs, "reps": 1,
                "seed0": seed, "one_params": ONE_PARAMS["on"], "varied_lengths": VARIED["on"], "late_fetch": late},
               timeout=1800)
    return r["times"][0], r["gc_s"][0]


def counters(w) -> dict:
    s = w.call({"op": "stats"})["stats"]
    out = {f"worker.{k}": v for k, v in s.get("timing", {}).items()}
    out.update({f"frontend.{k}": v for k, v in s.get("frontend", {}).items()})
    return out


def run_case(native, plugin, name, spec_of, n, plen, gen, reps) -> dict:
    rows = []
    before = counters(plugin)
    for rep in range(reps):
        specs = [spec_of(i) for i in range(n)]      # per rep: a workload may make each spec new
        tn, _ = timed(native, n, plen, gen, None, rep) if native is not None else (None, 0.0)
        # the plugin's variants in an order turning round by round
        arms = ["hooked", "unhooked"] + (["late"] if LATE["on"] else [])
        arms = arms[rep % len(arms):] + arms[:rep % len(arms)]
        got = {a: timed(plugin, n, plen, gen, None if a == "unhooked" else specs, rep, a == "late") for a in arms}
        (th, gh), (tu, gu) = got["hooked"], got["unhooked"]
        # gc: seconds the frontend spent in Python's cyclic collector within the timing
        rows.append({"native_s": tn if tn is not None else tu, "unhooked_s": tu, "hooked_s": th,
                     "unhooked_gc_s": gu, "hooked_gc_s": gh, **({"hooked_late_s": got["late"][0]} if LATE["on"] else {})})
    after = counters(plugin)
    hooked_batches = reps * (2 if LATE["on"] else 1)     # --late-fetch: both hooked arms' stages
    hooked_requests = n * hooked_batches
    stages = {label: 1e6 * (after.get(k, 0) - before.get(k, 0)) / hooked_requests for k, label in STAGES.items()}
    res = {"workload": name, "n": n, "prompt_len": plen, "gen": gen, "reps": rows, "host_us_per_request": stages,
           "fetch_rpcs_per_rep": (after.get("frontend.fetches", 0) - before.get("frontend.fetches", 0)) / hooked_batches,
           "prepared_per_rep": (after.get("worker.fetches_prepared", 0)
                                - before.get("worker.fetches_prepared", 0)) / hooked_batches,
           "page_faults_per_request": (after.get("frontend.read_build_page_faults", 0)
                                       - before.get("frontend.read_build_page_faults", 0)) / hooked_requests}
    for est, num, den in (("in_engine", "hooked_s", "unhooked_s"), ("vs_native", "hooked_s", "native_s"),
                          ("late_in_engine", "hooked_late_s", "unhooked_s"), ("early_over_late", "hooked_s", "hooked_late_s")):
        if num in rows[0] and den in rows[0]:
            res[est] = median_ci([r[num] / r[den] for r in rows])
    res["tokens_per_s_native"] = n * gen / min(r["native_s"] for r in rows)
    res["gc_ms"] = [1e3 * median_ci([r[k] for r in rows])[0] for k in ("hooked_gc_s", "unhooked_gc_s")]
    print(f"  {name:32s} n={n:<4d} {plen}+{gen}: in-engine {res['in_engine'][0]:.3f} "
          f"[{res['in_engine'][1]:.3f}, {res['in_engine'][2]:.3f}]  vs native {res['vs_native'][0]:.3f}  "
          f"host/request " + ", ".join(f"{k.split(' ')[0]} {v:.0f}us" for k, v in stages.items() if v), flush=True)
    return res


def verdict(case: dict) -> str:
    """The case's in-engine ratio against its target of issue 17 ("" where it has none)."""
    prefill = case["gen"] == 1 and case["workload"] not in ("unused", *BIG)
    t = TARGETS.get(("prefill", True) if prefill else (case["workload"], False))
    if t is None:
        return ""
    ie = case["in_engine"]
    return ("met" if ie[2] <= t else "met by the median" if ie[0] <= t else "NOT met") + f" (<= {t})"


def report(result: dict) -> str:
    m = result["meta"]
    lines = [f"Run {m['started']}: vLLM {m.get('vllm')}, torch {m.get('torch')}, {m.get('gpu')}; model {m['shape']}; "
             f"wall {m.get('wall_s', 0):.0f} s. Ratios: median [95 % bootstrap interval] over reps."
             + (" Prompts of lengths spread over [PROMPT / 2, 3 * PROMPT / 2)." if result.get("varied_lengths") else "")
             + (" One SamplingParams per uniform batch." if result.get("one_params") else "") + " " + host_line(m),
             f"Engines' threads: {json.dumps({k: v.get('threads') for k, v in result.get('startup', {}).items()})}", "",
             "| workload | requests | prompt + generated | in-engine (hooked / unhooked) | vs native | target "
             "| frontend's garbage collection, ms: hooked / unhooked |",
             "|---|---|---|---|---|---|---|"]
    for r in result.get("cases", []):
        ie = r["in_engine"]
        gc_ms = r.get("gc_ms")
        lines.append(f"| {r['workload']} | {r['n']} | {r['prompt_len']} + {r['gen']} | {ie[0]:.3f} [{ie[1]:.3f}, "
                     f"{ie[2]:.3f}] | {r['vs_native'][0]:.3f} | {verdict(r)} | "
                     + (f"{gc_ms[0]:.1f} / {gc_ms[1]:.1f} |" if gc_ms else "– |"))
    late = [r for r in result.get("cases", []) if "late_in_engine" in r]
    if late:
        lines += ["", "--late-fetch: the same hooked batches with their fetch sent after the call (as before the "
                  "early fetch), on the same engine, its arm turning with the others; the stages below "
                  "average both hooked arms:", "",
                  "| workload | requests | prompt + generated | early fetch (hooked / unhooked) "
                  "| fetch after the call | early / late |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['n']} | {r['prompt_len']} + {r['gen']} | " + " | ".join(
                  f"{r[k][0]:.3f} [{r[k][1]:.3f}, {r[k][2]:.3f}]" for k in ("in_engine", "late_in_engine", "early_over_late"))
                  + " |" for r in late]
    lines += ["", "Plugin host time per hooked request by stage (µs, from its counters):", "",
              "| workload | requests | gen | " + " | ".join(STAGES.values()) + " | fetch RPCs per batch "
              "| replies made ahead and used per batch | frontend page faults in read and build, per request |",
              "|---|---|---|" + "---|" * (len(STAGES) + 3)]
    for r in result.get("cases", []):
        lines.append(f"| {r['workload']} | {r['n']} | {r['gen']} | " +
                     " | ".join(f"{r['host_us_per_request'][s]:.0f}" for s in STAGES.values()) +
                     f" | {r.get('fetch_rpcs_per_rep', 0):.1f} | {r.get('prepared_per_rep', 0):.1f} "
                     f"| {r.get('page_faults_per_request', 0):.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--batches", nargs="+", help="NxPROMPT+GEN (default 64x128+1 64x128+128 256x128+1 "
                    "256x128+128; with --smoke 8x16+1 8x16+4)")
    ap.add_argument("--no-big", action="store_true", help="skip the all-layer all-token capture case")
    ap.add_argument("--only-big", action="store_true", help="run only the all-layer all-token capture case")
    ap.add_argument("--workloads", nargs="+", default=["unused", "steer_add_all_layers", "steer_add_1_layer",
                                                        "capture_last_prompt_4_layers", "capture_all_tokens_4_layers",
                                                        "mixed_thirds"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--plugin-config", type=json.loads, default={},
                    help='more vllm_hook settings for the plugin engine, JSON (e.g. \'{"result_arena_bytes": 0}\')')
    ap.add_argument("--no-native", action="store_true",
                    help="no native engine (\"vs native\" then reads the plugin engine unhooked)")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of every engine process (e.g. OMP_WAIT_POLICY=PASSIVE)")
    ap.add_argument("--frontend-threads", type=int,
                    help="torch.set_num_threads in every engine's frontend process after start-up")
    ap.add_argument("--no-warmup", action="store_true",
                    help="measure from the engine's first hooked batch (default: one untimed batch per workload first)")
    ap.add_argument("--one-params", action="store_true",
                    help="a batch whose requests share one spec gets one SamplingParams for every prompt, as "
                    "users pass it (default: one per request, each with its own spec object, as served)")
    ap.add_argument("--varied-lengths", action="store_true",
                    help="prompts of lengths spread over [PROMPT / 2, 3 * PROMPT / 2), as a dataset's "
                    "(default: every prompt PROMPT tokens)")
    ap.add_argument("--gpu-mem", type=float, default=0.35)
    ap.add_argument("--late-fetch", action="store_true",
                    help="also time each hooked batch with its fetch sent after the call, not at its last step")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny batches")
    args = ap.parse_args()
    LATE["on"] = args.late_fetch
    ONE_PARAMS["on"] = args.one_params
    VARIED["on"] = args.varied_lengths
    out = Path(args.out)
    model, base = model_and_base(args, max_num_seqs=256, smoke_kv_bytes=256 << 20)
    big = (32, 512)
    if args.smoke:
        big = (4, 64)
        args.batches = args.batches or ([] if args.only_big else ["8x16+1", "8x16+4"])
        args.reps = min(args.reps, 2)
    args.batches = [] if args.only_big else (args.batches or ["64x128+1", "64x128+128", "256x128+1", "256x128+128"])
    cfg = json.loads((Path(model) / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    wl = workloads(L)
    result = Record(out, run_meta(model, cfg), render=report, startup={}, cases=[],
                    varied_lengths=args.varied_lengths, one_params=args.one_params)
    save = result.save

    engines = {}
    try:
        plugin_cfg = {"capture_pool_rows": 1 << 19, **args.plugin_config}
        for name, native, extra in ((("native", True, {}),) if not args.no_native else ()) + (
                                    # every layer of a full 16,384-token step: 458,752 rows (run 40
                                    # stopped at 1 << 17)
                                    ("plugin", False, {"additional_config": {"vllm_hook": plugin_cfg}}),):
            w, info = start(name, model, {**base, **extra}, out, native=native,
                            env=dict(kv.split("=", 1) for kv in args.env), frontend_threads=args.frontend_threads)
            engines[name] = w
            result["startup"][name] = {k: v for k, v in info.items() if k != "stats"}
        engines["plugin"].call({"op": "register_bench_vectors", "hidden": cfg["hidden_size"]})
        if args.batches and not args.no_warmup:
            # One untimed hooked batch of each workload first: a process's first fetch maps the
            # workers' result arena and its first captures touch fresh memory (run 90: 0.2 s
            # once), which would otherwise land in the first measured case's first rep.
            n, rest = args.batches[0].split("x")
            plen, gen = rest.split("+")
            result["warmup_s"] = {name: timed(engines["plugin"], int(n), int(plen), int(gen),
                                              [wl[name](i) for i in range(int(n))], 0)[0]
                                  for name in args.workloads}
        for b in args.batches:
            n, rest = b.split("x")
            plen, gen = rest.split("+")
            for name in args.workloads:
                result["cases"].append(run_case(engines.get("native"), engines["plugin"], name, wl[name],
                                                int(n), int(plen), int(gen), args.reps))
                save()
        n, plen = big
        for name in () if args.no_big or args.no_warmup else BIG:
            # untimed, as above (run 151's first big batch, with no warm-up: 2.0 s against 0.18)
            result.setdefault("warmup_s", {})[name] = timed(engines["plugin"], n, plen, 1,
                                                            [wl[name](i) for i in range(n)], 0)[0]
        for name in () if args.no_big else BIG:
            result["cases"].append(run_case(engines.get("native"), engines["plugin"], name, wl[name], n, plen, 1,
                                            args.reps))
            save()
    finally:
        for w in engines.values():
            w.close()
        save()
    print(report(result))


if __name__ == "__main__":
    main()
