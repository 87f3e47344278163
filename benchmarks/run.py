"""vllm-hook benchmark suite and GPU check: native vLLM and vllm-hook side by side, one run.

    python benchmarks/run.py --suite bench --model PATH --out DIR      # speed, memory, start-up
    python benchmarks/run.py --suite check --model PATH --out DIR      # graphs vs eager (issue 4)
    python benchmarks/run.py --smoke --out DIR                         # CPU, tiny model, no timing claims

Each engine lives in its own process (`engine_worker.py`): native (VLLM_HOOK_DISABLE=1) and
plugin engines are alive together and every measurement alternates between them, so drift hits
both. Engines start one after another, each with empty compile caches (cold start-up).
Writes DIR/results.json and DIR/report.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOG_PATTERNS = {
    "graph_gib": re.compile(r"Graph capturing finished in \S+ secs, took ([\d.]+) GiB"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)"),
    "compile_s": re.compile(r"compilation: ([\d.]+) s"),
    "kv_tokens": re.compile(r"KV cache size: ([\d,]+) tokens"),
}


class Worker:
    def __init__(self, name: str, cfg: dict, log_dir: Path, cpus: list[int] | None = None):
        self.name = name
        self.log = open(log_dir / f"{name}.log", "w")
        env = dict(os.environ)
        cache = tempfile.mkdtemp(prefix=f"vh_cache_{name}_")
        env.update(VLLM_CACHE_ROOT=cache, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
                   TRITON_CACHE_DIR=f"{cache}/triton", PYTHONUNBUFFERED="1")
        if cfg.get("native"):
            env["VLLM_HOOK_DISABLE"] = "1"
        env.update(cfg.get("env") or {})
        self.proc = subprocess.Popen([sys.executable, str(HERE / "engine_worker.py"), json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        if cpus:
            # Before the engine spawns its core process, which inherits it: engines alive
            # together then never compete for the same cores (their idle threads spin).
            os.sched_setaffinity(self.proc.pid, cpus)
        self.replies: queue.Queue = queue.Queue()
        self.figures: dict = {}
        self.tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.replies.put(json.loads(line[3:]))
                continue
            self.log.write(line)
            self.tail = (self.tail + [line])[-40:]
            for k, pat in LOG_PATTERNS.items():
                m = pat.search(line)
                # The last graph capture counts: vLLM 0.33 first captures for its memory profile.
                if m and (k not in self.figures or k == "graph_gib"):
                    self.figures[k] = float(m.group(1).replace(",", ""))
        self.replies.put({"error": f"{self.name} exited", "tail": "".join(self.tail)})

    def wait(self, timeout: float) -> dict:
        try:
            r = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no reply in {timeout} s\n" + "".join(self.tail)) from None
        if "error" in r:
            raise RuntimeError(f"{self.name}: {r['error']}\n{r.get('trace', '')}{r.get('tail', '')}")
        return r

    def call(self, cmd: dict, timeout: float = 300) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.wait(timeout)

    def close(self):
        try:
            self.call({"op": "quit"}, timeout=30)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start(name, model, llm_kwargs, log_dir, native=False, timeout=900, cpus=None, env=None,
          frontend_threads=None) -> tuple[Worker, dict]:
    w = Worker(name, {"model": model, "llm": llm_kwargs, "native": native, "env": env,
                      "frontend_threads": frontend_threads}, log_dir, cpus)
    ready = w.wait(timeout)
    info = {"startup_s": ready["startup_s"], **w.figures, "threads": ready.get("threads"),
            "stats": ready.get("stats", {})}
    print(f"[{name}] ready: {json.dumps({k: v for k, v in info.items() if k != 'stats'})}", flush=True)
    return w, info


# --------------------------------------------------------------------------------------------
def model_and_base(args, max_num_seqs: int, smoke_kv_bytes: int = 64 << 20) -> tuple[str, dict]:
    """The checkpoint and the LLM arguments every engine of a benchmark shares: the tiny CPU
    fixture with --smoke (eager: a smoke checks that the script runs, and compiling would
    double its engines' start-up on the CPU), else the --model (or a random --shape built on the
    machine), bf16."""
    if args.smoke:
        from vllm_hook.testing.tiny_models import tiny_model

        return tiny_model("qwen2"), dict(dtype="float32", max_model_len=1024, max_num_seqs=max_num_seqs,
                                         kv_cache_memory_bytes=smoke_kv_bytes, disable_log_stats=False, seed=0,
                                         enforce_eager=True)
    from make_model import build

    return args.model or build(args.shape, "/tmp/vh_models"), dict(
        dtype="bfloat16", max_model_len=4096, max_num_seqs=max_num_seqs, skip_tokenizer_init=True,
        gpu_memory_utilization=args.gpu_mem, seed=0, disable_log_stats=False)


def tracker_layers(L: int) -> list[int]:
    return sorted({L // 7, (2 * L) // 7 + 1, (4 * L) // 7, L - 2})


def full_config(L: int) -> dict:
    """Opt-in features at exactly the layers the workloads and checks use."""
    return {"sites": ["resid_post", "resid_pre", "q"], "site_layers": sorted({0, *tracker_layers(L)}),
            "projection_layers": sorted({2, L // 3, L // 2, (2 * L) // 3}), "capture_pool_rows": 65536}


def workloads(L: int) -> dict:
    mid = L // 2
    four = tracker_layers(L)
    steer1 = {"steer": [{"op": "add", "layer": mid, "vector": "bench_a", "scale": 0.5}]}
    cap4 = {"capture": [{"layers": four, "tokens": "all"}]}

    def steer_all(scale: float) -> dict:
        return {"steer": [{"op": "add", "layer": x, "vector": "bench_a", "scale": scale} for x in range(L)]}

    return {
        "unused": lambda i: None,
        "steer_add_1_layer": lambda i: steer1,
        "steer_add_all_layers": lambda i: {"steer": [{"op": "add", "layer": x, "vector": "bench_a",
                                                      "scale": 0.05} for x in range(L)]},
        # The same with a scale of each request's own, new at every call (steering per user):
        # no spec ever repeats, so none is an exact hit in the frontend's cache
        "steer_add_all_layers_own_scale": lambda i: steer_all(0.05 * (1 + next(_FRESH) / (1 << 20))),
        # A strength sweep: 8 scales over the batch's prompts (each scale's later requests repeat it)
        "steer_add_all_layers_8_scales": lambda i: steer_all(0.05 * (1 + (i % 8) / 8)),
        "cap_1_layer": lambda i: {"steer": [{"op": "cap", "layer": mid, "vector": "bench_b", "min": -1.0,
                                             "max": 1.0}]},
        "capture_last_prompt_4_layers": lambda i: {"capture": [{"layers": four, "tokens": "last_prompt"}]},
        "capture_last_prompt_all_layers": lambda i: {"capture": [{"layers": "all", "tokens": "last_prompt"}]},
        "capture_all_tokens_4_layers": lambda i: cap4,
        "capture_all_tokens_all_layers": lambda i: {"capture": [{"layers": "all", "tokens": "all"}]},
        # The same delivered in the model's dtype (bf16: half the bytes, no conversion).
        "capture_all_tokens_all_layers_model_dtype": lambda i: {"capture": [{"layers": "all", "tokens": "all"}],
                                                                "dtype": "model"},
        "mixed_thirds": lambda i: [steer1, cap4, None][i % 3],
        # The same with the every-token third delivered in the model's dtype: what the
        # float32 default's widening on the host costs the mixed batch
        "mixed_thirds_model_dtype": lambda i: [steer1, {**cap4, "dtype": "model"}, None][i % 3],
        "attention_tracker_4_layers": lambda i: {"capture": [{"site": "attn_scores", "layers": four,
                                                              "tokens": "last_prompt"}]},
    }


# Decode-time workloads run only when named (--workloads): the throughput benchmarks' rows.
OPT_IN = {"steer_add_all_layers_own_scale", "steer_add_all_layers_8_scales", "mixed_thirds_model_dtype"}
_FRESH = itertools.count(1)         # the own-scale workload's scales: never the same twice


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def tpot(w: Worker, n, plen, gen, specs, reps) -> dict:
    """Decode time per output token of a batch of n, median of reps, by up to three methods:
    `step` (the median interval between the engine core's decode steps: robust to a stalled
    step, no IPC), `timestamps` (vLLM's per-request first/last token times: a mean, so one
    stall moves it) and `wall` ((W(gen+1) - W(1)) / gen, when neither is reported)."""
    b = w.call({"op": "time", "n": n, "prompt_len": plen, "max_tokens": gen + 1, "specs": specs, "reps": reps})
    res = {"wall_s": median(b["times"]), "step_pct": (b.get("step_ms_p10_p50_p90") or [None])[0],
           "sm_clock": (b.get("sm_clock_mhz") or [None])[0], "host_us": (b.get("step_host_us") or [None])[0],
           "repeat_us": (b.get("repeat_host_us") or [None])[0]}
    for key, method in (("step_tpot", "step"), ("decode_tpot", "timestamps")):
        if all(t is not None for t in b.get(key) or [None]):
            res[method] = median(b[key])
    if not ("step" in res or "timestamps" in res):
        a = w.call({"op": "time", "n": n, "prompt_len": plen, "max_tokens": 1, "specs": specs, "reps": reps})
        res["wall"] = (median(b["times"]) - median(a["times"])) / gen
    res["method"] = next(m for m in ("step", "timestamps", "wall") if m in res)
    return res


# Workloads run on the default ("lean") plugin engine, except: those that need opt-in features
# on the "full" engine (projection ops and q capture at the layers they use), and the
# capture-only engine's rows (steer_layers: none, so no steering math in the graph).
ENGINE_OF = {"unused_full_engine": "plugin_full", "cap_1_layer": "plugin_full",
             "attention_tracker_4_layers": "plugin_full", "unused_capture_only_engine": "plugin_capture_only",
             "capture_last_prompt_4_layers_capture_only_engine": "plugin_capture_only"}


def bench(workers: dict[str, Worker], L: int, args, save) -> dict:
    out: dict = {"tpot": [], "prefill": [], "capture_e2e": []}
    native, lean = workers["native_graph"], workers["plugin_lean"]
    wl = workloads(L)
    wl["unused_full_engine"] = wl["unused"]
    wl["unused_capture_only_engine"] = wl["unused"]
    wl["capture_last_prompt_4_layers_capture_only_engine"] = wl["capture_last_prompt_4_layers"]
    timed = {k: v for k, v in wl.items() if ENGINE_OF.get(k, "plugin_lean") in workers
             and (k in args.workloads if args.workloads else k not in OPT_IN)}
    for c in args.concurrency if "tpot" in args.sections else ():
        for name, make in timed.items():
            specs = [make(i) for i in range(c)]
            plugin = workers[ENGINE_OF.get(name, "plugin_lean")]
            for rep in range(args.reps):
                rn = tpot(native, c, args.prompt_len, args.gen, None, 1)
                # The same batch without specs on the same plugin engine, next to the hooked
                # one (order alternating per rep): one process, so both share its speed mode
                # (the lent machine's processes switch between a fast and a slow mode, run
                # 18), which the native pair does not.
                # (For `unused` both are the same batch: the estimator's own null control.)
                pair = args.in_engine
                ru = tpot(plugin, c, args.prompt_len, args.gen, None, 1) if pair and rep % 2 else None
                rp = tpot(plugin, c, args.prompt_len, args.gen, specs, 1)
                if pair and not rep % 2:
                    ru = tpot(plugin, c, args.prompt_len, args.gen, None, 1)
                m = rn["method"]
                row = {"workload": name, "concurrency": c, "rep": rep, "native_s": rn[m], "plugin_s": rp[m],
                       "native_wall_s": rn["wall_s"], "plugin_wall_s": rp["wall_s"], "engine": plugin.name,
                       "method": m, "native_step_ms_p10_p50_p90": rn["step_pct"],
                       "plugin_step_ms_p10_p50_p90": rp["step_pct"], "native_sm_mhz": rn["sm_clock"],
                       "plugin_sm_mhz": rp["sm_clock"], "plugin_step_host_us": rp["host_us"],
                       "plugin_repeat_host_us": rp["repeat_us"]}
                if ru is not None:
                    row["plugin_unused_s"] = ru[m]
                if "timestamps" in rn and "timestamps" in rp:
                    row.update(native_ts_s=rn["timestamps"], plugin_ts_s=rp["timestamps"])
                out["tpot"].append(row)
            rows = [r for r in out["tpot"] if r["workload"] == name and r["concurrency"] == c]
            ratio = median([r["plugin_s"] for r in rows]) / median([r["native_s"] for r in rows])
            print(f"  tpot c={c:<3} {name:32s} native {1e3 * median([r['native_s'] for r in rows]):7.3f} ms"
                  f"  plugin {1e3 * median([r['plugin_s'] for r in rows]):7.3f} ms  x{ratio:.3f}", flush=True)
        save()
    plugin = lean
    for plen in args.prefill_lens if "prefill" in args.sections else ():
        for name in ("unused", "capture_all_tokens_all_layers"):
            spec = wl[name](0)
            tn = native.call({"op": "time", "n": 1, "prompt_len": plen, "max_tokens": 1, "reps": args.reps + 2})
            tp = plugin.call({"op": "time", "n": 1, "prompt_len": plen, "max_tokens": 1, "specs": [spec],
                              "reps": args.reps + 2})
            out["prefill"].append({"prompt_len": plen, "workload": name, "native_s": median(tn["times"]),
                                   "plugin_s": median(tp["times"]), "capture_bytes": tp["capture_bytes"]})
            print(f"  prefill {plen:4d} {name:32s} native {1e3 * median(tn['times']):7.2f} ms  plugin "
                  f"{1e3 * median(tp['times']):7.2f} ms", flush=True)
    e2e = [(1, "capture_all_tokens_all_layers"), (1, "capture_all_tokens_all_layers_model_dtype"),
           (16, "capture_all_tokens_all_layers"), (1, "attention_tracker_4_layers")]
    wl["capture_all_tokens_all_layers_model_dtype"] = lambda i: {
        **wl["capture_all_tokens_all_layers"](i), "dtype": "model"}
    for gen, name in e2e if "e2e" in args.sections else ():
        if ENGINE_OF.get(name, "plugin_lean") not in workers:
            continue
        spec = wl[name](0)
        plugin = workers[ENGINE_OF.get(name, "plugin_lean")]
        tn = native.call({"op": "time", "n": 1, "prompt_len": 512, "max_tokens": gen, "reps": args.reps + 2})
        before = plugin.call({"op": "stats"})["stats"]
        tp = plugin.call({"op": "time", "n": 1, "prompt_len": 512, "max_tokens": gen, "specs": [spec],
                          "reps": args.reps + 2})
        stages = delivery_stages(before, plugin.call({"op": "stats"})["stats"])
        out["capture_e2e"].append({"workload": name, "prompt_len": 512, "max_tokens": gen,
                                   "native_s": median(tn["times"]), "native_times": tn["times"],
                                   "plugin_s": median(tp["times"]), "plugin_times": tp["times"],
                                   "capture_bytes": tp["capture_bytes"], "stages_ms": stages})
        print(f"  e2e {name} 512 tok, {gen} gen: native {1e3 * median(tn['times']):.1f} ms, plugin "
              f"{1e3 * median(tp['times']):.1f} ms, {tp['capture_bytes'] / 2**20:.1f} MiB", flush=True)
    out["plugin_stats"] = lean.call({"op": "stats"})["stats"]
    if "plugin_full" in workers:
        out["plugin_full_stats"] = workers["plugin_full"].call({"op": "stats"})["stats"]
    return out


def delivery_stages(before: dict, after: dict) -> dict:
    """Mean ms per fetch of each delivery stage between two `vllm_hook.stats` snapshots:
    the frontend's RPC (which contains the worker's fetch: draining copies, writing), its
    read of the results and its build of `Results`."""
    w0, w1 = before.get("timing", {}), after.get("timing", {})
    f0, f1 = before.get("frontend", {}), after.get("frontend", {})
    n = max(f1.get("fetches", 0) - f0.get("fetches", 0), 1)
    out = {f"frontend {k[:-2]}": 1e3 * (f1.get(k, 0) - f0.get(k, 0)) / n
           for k in ("fetch_rpc_s", "read_s", "build_s")}
    out.update({f"worker {k[:-2]}": 1e3 * (w1.get(k, 0) - w0.get(k, 0)) / n for k in ("fetch_s", "write_s")})
    return out


# --------------------------------------------------------------------------------------------
def check(engines: dict[str, Worker], L: int, args) -> dict:
    """Graphs vs eager, plugin vs native, on one batch. bf16 on a random-weight model is
    chaotic (greedy tokens of native graphs and native eager drift apart too), so besides
    tokens it compares what does not compound: the first step's logprobs and prompt-row
    captures, each against the native graph-vs-eager noise floor."""
    four = tracker_layers(L)
    specs = [
        None,
        {"steer": [{"op": "add", "layer": L // 3, "vector": "bench_a", "scale": 1.0, "norm_match": True}]},
        {"steer": [{"op": "cap", "layer": L // 2, "vector": "bench_b", "min": -0.5, "max": 0.5},
                   {"op": "ablate", "layer": (2 * L) // 3, "vector": "bench_a"}]},
        {"capture": [{"layers": "all", "tokens": "last_prompt"}, {"layers": [L - 1], "tokens": "generated"}]},
        {"steer": [{"op": "add", "layer": 2, "vector": "bench_a", "scale": 2.0, "norm_match": True}],
         "capture": [{"layers": [2, L // 2], "tokens": "all"}]},
        None,
        {"capture": [{"site": "attn_scores", "layers": four, "tokens": "prompt"},
                     {"site": "q", "layers": [0], "tokens": "last_prompt"}]},
        {"hooks": [{"name": "zero_dims", "args": {"layers": [L // 2], "dims": list(range(64))}}],
         "capture": [{"layers": [L // 2], "tokens": "all"}]},
        {"hooks": [{"name": "stream_norms", "args": {"layers": four}}], "capture": [{"layers": four}]},
    ]
    P = 64
    save = tempfile.mkdtemp(prefix="vh_check_")
    res = {}
    for name, w in engines.items():
        res[name] = w.call({"op": "outputs", "n": len(specs), "prompt_len": P, "max_tokens": 24,
                            "specs": specs, "save_dir": save, "tag": name, "logprobs": 5})["outputs"]
    tok = {k: [o["tokens"] for o in v] for k, v in res.items()}
    out = {"specs": [json.dumps(s)[:160] if s else None for s in specs], "tokens": tok}
    out["checks"], out["capture_err"] = _checks(res, tok, L, P, "native_graph", "plugin_graph")
    if "plugin_breakable" in res:
        out["checks_breakable"], out["capture_err_breakable"] = _checks(
            res, tok, L, P, "native_breakable", "plugin_breakable")
    return out


def _checks(res: dict, tok: dict, L: int, P: int, ng: str, pg: str) -> tuple[dict, dict]:
    """The check's comparisons for one pair of graph engines (native `ng`, plugin `pg`)
    against the eager pair."""
    from safetensors.torch import load_file

    import vllm_hook

    four, mid = tracker_layers(L), L // 2

    def cap_err(i, keys_filter):
        g, e = load_file(res[pg][i]["saved"]), load_file(res["plugin_eager"][i]["saved"])
        errs = {}
        for k in g:
            if k.endswith(".positions") or k == "token_ids" or not keys_filter(k):
                continue
            pos = g[k + ".positions"]
            keep = pos < P                      # prompt rows: same inputs in both modes
            a, b = g[k][keep].float(), e[k][e[k + ".positions"] < P].float()
            errs[k] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if "attn" not in k \
                else float((a - b).abs().max())
        return errs

    unhooked, steered, hooked = (0, 3, 5, 6), (1, 2, 4), (7, 8)
    c = {
        "noise_floor_native_graph_vs_eager": {
            "token_agreement": _agree(tok[ng], tok["native_eager"]),
            "first_step_logprob_diff": logprob_gap(res, "native_eager", ng, unhooked + steered + hooked)},
        "unhooked_plugin_vs_native_graph": {
            "token_agreement": _agree([tok[pg][i] for i in unhooked], [tok[ng][i] for i in unhooked]),
            "first_step_logprob_diff": logprob_gap(res, pg, ng, unhooked)},
        "unhooked_plugin_vs_native_eager": {
            "token_agreement": _agree([tok["plugin_eager"][i] for i in unhooked], [tok["native_eager"][i] for i in unhooked]),
            "first_step_logprob_diff": logprob_gap(res, "plugin_eager", "native_eager", unhooked)},
        "steered_graph_vs_eager": {
            "token_agreement": _agree([tok[pg][i] for i in steered], [tok["plugin_eager"][i] for i in steered]),
            "first_step_logprob_diff": logprob_gap(res, "plugin_eager", pg, steered)},
        "steering_effect_vs_native_graph": {
            "first_step_logprob_diff": logprob_gap(res, pg, ng, steered),
            "tokens_changed": [tok[pg][i] != tok[ng][i] for i in steered]},
        "hooked_graph_vs_eager": {
            "token_agreement": _agree([tok[pg][i] for i in hooked], [tok["plugin_eager"][i] for i in hooked]),
            "first_step_logprob_diff": logprob_gap(res, "plugin_eager", pg, hooked)},
        "modifying_hook_effect_vs_native_graph_first_logprob": logprob_gap(res, pg, ng, [7]),
    }
    caps = {**{f"req3.{k}": v for k, v in cap_err(3, lambda k: True).items()},
            **{f"req4.{k}": v for k, v in cap_err(4, lambda k: True).items()}}
    attn = {f"req6.{k}": v for k, v in cap_err(6, lambda k: k.startswith("attn_scores")).items()}
    qerr = {f"req6.{k}": v for k, v in cap_err(6, lambda k: k.startswith("q.")).items()}
    c["prompt_capture_rel_err_graph_vs_eager_max"] = max(caps.values())
    c["steered_prompt_capture_rel_err_graph_vs_eager_max"] = max(v for k, v in caps.items() if k.startswith("req4"))
    c["attn_scores_abs_err_graph_vs_eager_max"] = max(attn.values())
    c["q_rel_err_graph_vs_eager"] = max(qerr.values())
    # Hooks: the zeroed coordinates are exactly zero in every row (prompt and generated), and
    # the read-only hook's norms equal the same request's capture (same engine) and eager's.
    z = [vllm_hook.Results.load(res[n][7]["saved"]) for n in (pg, "plugin_eager")]
    c["modifying_hook_zeroed_dims_exactly"] = all(
        float(r.activations["resid_post"][mid][:, :64].abs().max()) == 0.0 for r in z)
    g, e = (vllm_hook.Results.load(res[n][8]["saved"]) for n in (pg, "plugin_eager"))
    hook_vs_cap, norms_err = 0.0, 0.0
    for x in four:
        hg = torch_cat(g.hook_results[0][f"layer{x}"]).float()
        he = torch_cat(e.hook_results[0][f"layer{x}"]).float()
        cap = g.activations["resid_post"][x].float().norm(dim=-1)
        hook_vs_cap = max(hook_vs_cap, float((hg[:len(cap)] - cap).abs().max() / cap.abs().max()))
        n = min(len(hg), len(he), P)            # prompt rows: same inputs in both modes
        norms_err = max(norms_err, float((hg[:n] - he[:n]).abs().max() / he[:n].abs().max()))
    c["read_only_hook_vs_capture_same_engine_rel"] = hook_vs_cap
    c["read_only_hook_prompt_norms_graph_vs_eager_rel"] = norms_err
    return c, {**caps, **attn, **qerr}


def torch_cat(xs):
    import torch

    return torch.cat(xs)


def _agree(a, b) -> float:
    tot = sum(len(x) for x in a)
    same = sum(sum(1 for p, q in zip(x, y) if p == q) for x, y in zip(a, b))
    return same / max(tot, 1)


# --------------------------------------------------------------------------------------------
def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--suite", choices=["bench", "check", "all"], default="all")
    ap.add_argument("--breakable", action="store_true",
                    help="check: also a native and a plugin engine on vLLM's breakable CUDA graphs "
                         "(VLLM_USE_BREAKABLE_CUDAGRAPH=1), against the same eager engines")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny workload: checks the suite runs")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gpu-mem", type=float, default=0.2)
    ap.add_argument("--engines", nargs="+", help="bench: only these engines (native_graph and "
                    "plugin_lean always run; plugin_capture_only, plugin_full)")
    ap.add_argument("--workloads", nargs="+", help="bench: only these decode-time workloads")
    ap.add_argument("--sections", nargs="+", default=["tpot", "prefill", "e2e"],
                    choices=["tpot", "prefill", "e2e"], help="bench: which measurements")
    ap.add_argument("--plugin-first", action="store_true",
                    help="start plugin_lean before native_graph (a check that the engines' start order "
                         "does not decide the native/plugin ratio)")
    ap.add_argument("--in-engine", action="store_true",
                    help="tpot: after each hooked measurement, time the same batch without specs on the "
                         "same plugin engine (the `in-engine` column: hooked over unhooked, one process)")
    ap.add_argument("--pin-cpus", action="store_true",
                    help="give each engine its own equal share of this machine's cores")
    args = ap.parse_args()
    out = Path(args.out)
    sys.path.insert(0, str(HERE.parent / "src"))

    if args.smoke:
        from vllm_hook.testing.tiny_models import tiny_model

        model = tiny_model("qwen2")
        base = dict(dtype="float32", max_model_len=1024, max_num_seqs=16, kv_cache_memory_bytes=64 << 20,
                    enforce_eager=True)
        args.concurrency, args.prefill_lens, args.gen, args.reps, args.prompt_len = [2], [16, 64], 4, 1, 32
    else:
        from make_model import build  # benchmarks/make_model.py

        model = args.model or build(args.shape, "/tmp/vh_models")
        base = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=64, skip_tokenizer_init=True,
                    gpu_memory_utilization=args.gpu_mem, seed=0, disable_log_stats=False)
    cfg = json.loads((Path(model) / "config.json").read_text())
    L, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    args.hidden = hidden
    workers: dict[str, Worker] = {}
    result = Record(out, run_meta(model, cfg, suite=args.suite), startup={}, configs={"full": full_config(L)})
    save = result.save

    lean_cfg = {"vllm_hook": {"capture_pool_rows": 65536}}
    full_cfg = {"vllm_hook": full_config(L)}
    if args.suite in ("check", "all"):
        # The check's hooked requests (7, 8) run Python hooks at these layers.
        full_cfg["vllm_hook"]["hook_layers"] = sorted({*tracker_layers(L), L // 2})
    plan = [("native_graph", True, {})]
    if args.suite in ("bench", "all"):
        plan += [("plugin_lean", False, {"additional_config": lean_cfg}),
                 ("plugin_capture_only", False, {"additional_config": {"vllm_hook": {
                     **lean_cfg["vllm_hook"], "steer_layers": None}}})]
    if args.suite != "bench" or not args.engines or "plugin_full" in args.engines:
        plan += [("plugin_full", False, {"additional_config": full_cfg})]
    if args.suite == "bench" and args.engines:
        plan = [p for p in plan if p[0] in ("native_graph", "plugin_lean", *args.engines)]
    if args.suite in ("check", "all"):
        plan += [("native_eager", True, {"enforce_eager": True}),
                 ("plugin_full_eager", False, {"enforce_eager": True, "additional_config": full_cfg})]
        if args.breakable:
            plan += [("native_breakable", True, {}), ("plugin_breakable", False, {"additional_config": full_cfg})]
    if args.plugin_first:
        plan.sort(key=lambda p: p[0] != "plugin_lean")
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // len(plan)
    try:
        for i, (name, native, extra) in enumerate(plan):
            cpus = cores[i * share:(i + 1) * share] if args.pin_cpus and share else None
            env = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"} if name.endswith("_breakable") else None
            w, info = start(name, model, {**base, **extra}, out, native=native, cpus=cpus, env=env)
            info["cpus"] = cpus
            workers[name] = w
            result["startup"][name] = info
            if not native:
                w.call({"op": "register_bench_vectors", "hidden": hidden})
            save()
        if args.suite in ("bench", "all"):
            result["bench"] = bench(workers, L, args, save)
            save()
        if args.suite in ("check", "all"):
            engines = {"native_graph": workers["native_graph"], "plugin_graph": workers["plugin_full"],
                       "native_eager": workers["native_eager"], "plugin_eager": workers["plugin_full_eager"],
                       **{k: workers[k] for k in ("native_breakable", "plugin_breakable") if k in workers}}
            result["check"] = check(engines, L, args)
            print(json.dumps({k: v for k, v in result["check"].items() if k.startswith("checks")}, indent=1),
                  flush=True)
    finally:
        for w in workers.values():
            w.close()
        save()
    from report import write_report  # benchmarks/report.py

    (out / "report.md").write_text(write_report(result))
    print((out / "report.md").read_text())


# ---- shared by the benchmark scripts of this folder ----------------------------------------

def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every benchmark here takes: --model, --shape, --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: build one, see --shape)")
    ap.add_argument("--shape", default="qwen2-1.5b", help="model shape to build when --model is absent")
    ap.add_argument("--out", required=True)
    return ap


SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")


def host_probe(reps: int = 7) -> dict:
    """The host's speed and steadiness for one Python thread: a fixed loop timed `reps` times
    (ms: min, median, max), the load average and core count. Lent machines differ: runs 130
    to 132 had native served batches 1.1 to 1.7x as long as run 129's on the same GPU kind,
    and their steering ratios' intervals were 9 to 19x as wide."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        sum(i * i for i in range(300_000))
        times.append(1e3 * (time.perf_counter() - t))
    times.sort()
    return {"python_loop_ms": [round(times[0], 2), round(times[reps // 2], 2), round(times[-1], 2)],
            "loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}


# The H100 host of run 133, the served figures of record: 12.84 / 13.06 / 13.16 ms.
STEADY_PROBE_MS = 13.2


def host_line(meta: dict) -> str:
    """A report's sentence on its host (`meta["host"]`): a host slower than the one of record
    or unsteady (runs 135 to 137: native batches 1.3 to 1.75x run 133's, the ratios' intervals
    1.8 to 45x as wide) is said to be, so its ratios are read as a diagnostic."""
    probe = (meta.get("host") or {}).get("python_loop_ms")
    if not probe:
        return ""
    lo, med, hi = probe
    slow = med > 1.15 * STEADY_PROBE_MS or hi > 1.15 * lo
    return (f"Host probe {lo} / {med} / {hi} ms (min / median / max; run 133's steady host: "
            f"{STEADY_PROBE_MS:g} or less)" + (": **a slow or unsteady host: a diagnostic run, not a figure "
                                             "of record**." if slow else "."))


def run_meta(model: str, cfg: dict, **extra) -> dict:
    """What a results file says about its run: model, shape, settings, command, versions, host."""
    return {"model": model, "shape": {k: cfg.get(k) for k in SHAPE_KEYS}, **extra, "argv": sys.argv,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), **_versions(), "host": host_probe()}


class Record(dict):
    """A run's results ({"meta": ..., sections}). save() rewrites DIR/results.json, and with a
    renderer DIR/report.md, after every case: a run cut short keeps what it measured."""

    def __init__(self, out: Path, meta: dict, render=None, **sections):
        super().__init__(meta=meta, **sections)
        self.out, self.render, self.t0 = Path(out), render, time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(meta), flush=True)

    def save(self) -> None:
        self["meta"]["wall_s"] = time.time() - self.t0
        (self.out / "results.json").write_text(json.dumps(self, indent=1))
        if self.render is not None:
            (self.out / "report.md").write_text(self.render(self))


def logprob_gap(outputs: dict, a: str, b: str, idx) -> float:
    """Max |logprob| difference, over requests `idx`, of engine b's top first token in a's."""
    worst = 0.0
    for i in idx:
        la, lb = outputs[a][i]["first_logprobs"], outputs[b][i]["first_logprobs"]
        top = max(lb, key=lb.get)
        worst = max(worst, abs(la.get(top, float("-inf")) - lb[top]))
    return worst


def _versions() -> dict:
    code = ("import json, torch, vllm, platform; print(json.dumps({'vllm': vllm.__version__, 'torch': "
            "torch.__version__, 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else "
            "platform.processor() or 'cpu'}))")
    try:
        return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                         timeout=300).stdout.strip().splitlines()[-1])
    except Exception as e:
        return {"versions_error": repr(e)}


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
