"""Per-kernel view of a decode step: native vLLM against the plugin, on the GPU.

    python benchmarks/profile_step.py --model PATH --out DIR [--engines native lean ...]

With `--workloads`, plugin engines also profile batches whose requests use the plugin (the
decode-time workloads of `run.py`), so each workload's GPU time per step compares with
native's on the same batch size: a figure the host's wall-clock noise does not move.
Each engine runs in its own process, in-process vLLM (no engine-core subprocess, so the torch
profiler sees the model runner), with empty compile caches. For each engine and batch size it
records, over a run of decode steps: CUDA kernels per step, GPU busy time per step, wall time
per step, CUDA runtime calls per step (graph launches among them), and the kernels by name.
It also keeps Inductor's generated code (the fused kernels) so the two engines' kernels can be
compared line by line.
Writes DIR/profile.json (every engine and batch size) and, per engine, DIR/<engine>.log,
DIR/<engine>_b<first batch size>_trace.json.gz (chrome trace) and DIR/<engine>_code.tar.gz.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

ENGINES = {
    "native": {"native": True},
    "lean": {"additional_config": {"vllm_hook": {}}},
    "capture_only": {"additional_config": {"vllm_hook": {"steer_layers": None}}},
    # With Inductor's bounds asserts on indexed loads and stores (HookConfig.index_asserts; the
    # default is off, run 12's "lean_noassert"); native_noassert shows what turning them off
    # alone does to native's own kernels.
    "lean_asserts": {"additional_config": {"vllm_hook": {"index_asserts": True}}},
    # Python hooks (issue 16): hook points at hooks_gpu.py's layers (set at start from the model).
    "hooks": {"additional_config": {"vllm_hook": {"hook_layers": "hooks_gpu"}}},
    # The same without steering math in the graph: what hook layers alone cost.
    "hooks_no_steer": {"additional_config": {"vllm_hook": {"hook_layers": "hooks_gpu", "steer_layers": None}}},
    # A second native process: the estimator's own spread between two identical engines.
    "native_again": {"native": True},
    "native_noassert": {"native": True,
                        "compilation_config": {"inductor_compile_config": {"assert_indirect_indexing": False}}},
}


def run_engine(name: str, model: str, out: Path, batch_sizes: list[int], gen: int,
               workload_names: list[str], stack: bool = False) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    extra = {k: v for k, v in ENGINES[name].items() if k != "native"}
    if name.startswith("hooks"):
        from run import tracker_layers

        L = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
        hook_cfg = {**extra["additional_config"]["vllm_hook"], "hook_layers": sorted({*tracker_layers(L), L // 2})}
        extra = {"additional_config": {"vllm_hook": hook_cfg}}
    llm = LLM(model, dtype="bfloat16", max_model_len=1024, max_num_seqs=64, skip_tokenizer_init=True,
              gpu_memory_utilization=0.3, seed=0, **extra)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    hf = llm.llm_engine.model_config.hf_config
    wl = {"none": lambda i: None}
    if not ENGINES[name].get("native"):
        import vllm_hook
        from run import workloads     # benchmarks/run.py: the suite's workloads

        g = torch.Generator().manual_seed(0)
        vllm_hook.register_vectors(llm, {v: torch.randn(hf.hidden_size, generator=g) for v in ("bench_a", "bench_b")})
        from engine_worker import python_hooks
        from hooks_gpu import workloads as hook_workloads

        all_wl = {**workloads(hf.num_hidden_layers), **hook_workloads(hf.num_hidden_layers)}
        for w in workload_names:
            spec = all_wl[w]       # run.py's: a function of the request index; hooks_gpu.py's: a spec
            wl[w] = spec if callable(spec) else (lambda i, s=python_hooks(spec): s)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    calls = itertools.count(1)

    def batch(n, plen=128):
        # New prompts every call: a cached prompt would skip native's prefill but not a
        # capture's (captures of prompt positions recompute them).
        c, lo = next(calls), min(1000, vocab // 4)
        return [{"prompt_token_ids": [lo + (c * 104729 + i * 7919 + j * 31) % (vocab - lo - 1) for j in range(plen)]}
                for i in range(n)]

    def gen_once(n, tokens, make=lambda i: None):
        sps = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                              extra_args={"vllm_hook": make(i)} if make(i) else None) for i in range(n)]
        sync()
        t = time.perf_counter()
        llm.generate(batch(n), sps, use_tqdm=False)
        sync()
        return time.perf_counter() - t

    res: dict = {}
    for n in batch_sizes:
        for w, make in wl.items():
            key = str(n) if w == "none" else f"{n}:{w}"
            res[key] = profile_batch(llm, gen_once, n, gen, make, out / f"{name}_b{key.replace(':', '_')}_trace.json",
                                     keep=(n == batch_sizes[0] and w in ("none", next(iter(workload_names), None))),
                                     stack=stack)
            print(name, key, json.dumps({k: v for k, v in res[key].items() if k != "kernels"}), flush=True)
    return res


def profile_batch(llm, gen_once, n: int, gen: int, make, trace: Path, keep: bool, stack: bool = False) -> dict:
    """Kernels, GPU busy time and wall time per decode step of a batch of n (requests' specs
    from `make`), over gen + 1 steps under the torch profiler; `wall_ms_per_step_median` is the
    median interval between the step's CUDA-graph launches (robust to a stalled step)."""
    from torch.profiler import ProfilerActivity, profile

    gen_once(n, 8, make)
    before = _timing(llm)
    w1 = min(gen_once(n, 1, make) for _ in range(3))
    wg = min(gen_once(n, gen + 1, make) for _ in range(3))
    after = _timing(llm)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
        gen_once(n, gen + 1, make)
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels: Counter = Counter()
    ktime: Counter = Counter()
    runtime: Counter = Counter()
    launches = []
    py: Counter = Counter()
    for e in events:
        if e.get("cat") == "python_function" and "dur" in e:
            py[e["name"]] += e["dur"]
        if e.get("cat") == "kernel":
            kernels[e["name"]] += 1
            ktime[e["name"]] += e.get("dur", 0)
        elif e.get("cat") == "cuda_runtime":
            runtime[e["name"]] += 1
            if e["name"] == "cudaGraphLaunch":
                launches.append(e["ts"])
    launches.sort()
    gaps = sorted(b - a for a, b in zip(launches, launches[1:]))
    steps = gen + 1
    res = {
        "tpot_ms_min_of_3": 1e3 * (wg - w1) / gen,
        "kernels_per_step": sum(kernels.values()) / steps,
        "gpu_busy_ms_per_step": sum(ktime.values()) / 1e3 / steps,
        "wall_ms_per_step_median": gaps[len(gaps) // 2] / 1e3 if gaps else None,
        # The plugin's own host time per hooked step, from its counters over the timed (not
        # profiled) calls: what a hooked step adds to vLLM's host work.
        "plugin_host_us_per_hooked_step": (
            1e6 * (after["step_host_s"] - before["step_host_s"]) / (after["hooked_steps"] - before["hooked_steps"])
            if after and after["hooked_steps"] > before["hooked_steps"] else None),
        # ... and its admission and finishing of requests, per request (6 timed calls of n).
        "plugin_events_us_per_request": (1e6 * (after.get("events_s", 0) - before.get("events_s", 0)) / (6 * n)
                                         if after else None),
        "runtime_calls_per_step": {k: v / steps for k, v in runtime.most_common(12)},
        "kernels": {k: [c, round(ktime[k] / c, 2)] for k, c in kernels.most_common(80)},
    }
    if stack:    # host time per step (inclusive, µs) of the plugin's functions and the busiest others
        res["python_us_per_step"] = {k: round(v / steps, 1) for k, v in py.most_common(60)}
        res["vllm_hook_us_per_step"] = dict(list({k: round(v / steps, 1) for k, v in py.most_common()
                                                  if "vllm_hook" in k}.items())[:40])
    if keep:
        with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
            g.write(f.read())
    trace.unlink()
    return res


def _timing(llm) -> dict | None:
    if os.environ.get("VLLM_HOOK_DISABLE"):
        return None
    import vllm_hook

    return vllm_hook.stats(llm)["timing"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", nargs="+", default=["native", "lean"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--workloads", nargs="*", default=[],
                    help="plugin engines: also profile batches using these run.py workloads")
    ap.add_argument("--stack", action="store_true",
                    help="record Python stacks: host time per step of the plugin's functions")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        r = run_engine(args.child, args.model, out, args.batch_sizes, args.gen, args.workloads, args.stack)
        (out / f"{args.child}.json").write_text(json.dumps(r, indent=1))
        return
    summary = {}
    for name in args.engines:
        cache = Path(tempfile.mkdtemp(prefix=f"vh_prof_{name}_"))
        env = dict(os.environ, VLLM_CACHE_ROOT=str(cache), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
                   TRITON_CACHE_DIR=str(cache / "triton"), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   PYTHONUNBUFFERED="1")
        if ENGINES[name].get("native"):
            env["VLLM_HOOK_DISABLE"] = "1"
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run([sys.executable, __file__, "--model", args.model, "--out", str(out),
                                 "--child", name, "--gen", str(args.gen), "--batch-sizes",
                                 *map(str, args.batch_sizes), "--workloads", *args.workloads,
                                 *(["--stack"] if args.stack else [])], env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        part = out / f"{name}.json"
        summary[name] = json.loads(part.read_text()) if rc == 0 and part.exists() else {"rc": rc}
        part.unlink(missing_ok=True)          # merged into profile.json (a device call returns 8 files)
        with tarfile.open(out / f"{name}_code.tar.gz", "w:gz") as tar:
            for p in cache.rglob("*.py"):
                tar.add(p, arcname=str(p.relative_to(cache)))
        print(name, "done rc", rc, flush=True)
    (out / "profile.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
