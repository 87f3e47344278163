"""Per-kernel view of a decode step: native vLLM against the plugin, on the GPU.

    python benchmarks/profile_step.py --model PATH --out DIR [--engines native lean ...]

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
    "native_noassert": {"native": True,
                        "compilation_config": {"inductor_compile_config": {"assert_indirect_indexing": False}}},
}


def run_engine(name: str, model: str, out: Path, batch_sizes: list[int], gen: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    extra = {k: v for k, v in ENGINES[name].items() if k != "native"}
    llm = LLM(model, dtype="bfloat16", max_model_len=1024, max_num_seqs=64, skip_tokenizer_init=True,
              gpu_memory_utilization=0.3, seed=0, **extra)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def batch(n, plen=128):
        lo = min(1000, vocab // 4)
        return [{"prompt_token_ids": [lo + (i * 7919 + j * 31) % (vocab - lo - 1) for j in range(plen)]}
                for i in range(n)]

    def gen_once(n, tokens):
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        sync()
        t = time.perf_counter()
        llm.generate(batch(n), sp, use_tqdm=False)
        sync()
        return time.perf_counter() - t

    res: dict = {}
    for n in batch_sizes:
        gen_once(n, 8)
        w1 = min(gen_once(n, 1) for _ in range(3))
        wg = min(gen_once(n, gen + 1) for _ in range(3))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen_once(n, gen + 1)
        trace = out / f"{name}_b{n}_trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        kernels: Counter = Counter()
        ktime: Counter = Counter()
        runtime: Counter = Counter()
        for e in events:
            if e.get("cat") == "kernel":
                kernels[e["name"]] += 1
                ktime[e["name"]] += e.get("dur", 0)
            elif e.get("cat") == "cuda_runtime":
                runtime[e["name"]] += 1
        steps = gen + 1
        res[str(n)] = {
            "tpot_ms_min_of_3": 1e3 * (wg - w1) / gen,
            "kernels_per_step": sum(kernels.values()) / steps,
            "gpu_busy_ms_per_step": sum(ktime.values()) / 1e3 / steps,
            "runtime_calls_per_step": {k: v / steps for k, v in runtime.most_common(12)},
            "kernels": {k: [c, round(ktime[k] / c, 2)] for k, c in kernels.most_common(80)},
        }
        if n == batch_sizes[0]:
            with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
                g.write(f.read())
        trace.unlink()
        print(name, n, json.dumps({k: v for k, v in res[str(n)].items() if k != "kernels"}), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", nargs="+", default=["native", "lean"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        r = run_engine(args.child, args.model, out, args.batch_sizes, args.gen)
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
                                 *map(str, args.batch_sizes)], env=env, stdout=log, stderr=subprocess.STDOUT).returncode
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
