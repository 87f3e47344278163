"""Where a hooked batch's host time goes: cProfile of one process running the whole engine.

    source scripts/gpu_env.sh && python3 benchmarks/profile_host.py --model /tmp/vh_models/qwen2-1.5b --out $OUT/prof
    python benchmarks/profile_host.py --smoke --out /tmp/prof                         # CPU, tiny model

The engine core and its worker run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so one
profile sees the frontend's admission and delivery, the scheduler and the worker's routing and
fetch. For each case (workload, requests, generated tokens) it times the batch unhooked and
hooked (4 alternating reps after 3 warm-ups, unprofiled), then profiles 3 hooked batches and
writes the plugin's counters over them, the top functions by own time and the plugin's by
cumulative time to OUT/prof.txt. Profiling slows pure-Python code several-fold: read it for
where time goes, and the throughput benchmark for how much.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from engine_worker import prompts  # noqa: E402
from run import workloads  # noqa: E402

CASES = (("capture_last_prompt_4_layers", 64, 1), ("steer_add_all_layers", 64, 1), ("mixed_thirds", 64, 1),
         ("capture_last_prompt_4_layers", 256, 128))
SMOKE_CASES = (("capture_last_prompt_4_layers", 8, 1), ("steer_add_all_layers", 8, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny 28-layer model, small batches")
    ap.add_argument("--cases", nargs="+", metavar="WORKLOAD:REQUESTS:GENERATED",
                    help="the cases to profile (default: %s)" % " ".join(f"{w}:{n}:{g}" for w, n, g in CASES))
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # engine core and worker in this process
    import torch
    from vllm import LLM, SamplingParams

    import vllm_hook

    hook_cfg = {"vllm_hook": {"capture_pool_rows": 1 << 19}}
    if args.smoke:
        from vllm_hook.testing.tiny_models import tiny_model

        model, cases, plen = tiny_model("qwen2", layers=28), SMOKE_CASES, 32
        llm = LLM(model, dtype="float32", max_model_len=512, max_num_seqs=64, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=256 << 20, enforce_eager=True, seed=0, additional_config=hook_cfg)
    else:
        model, cases, plen = args.model, CASES, 128
        llm = LLM(model, dtype="bfloat16", max_model_len=4096, max_num_seqs=256, skip_tokenizer_init=True,
                  gpu_memory_utilization=0.35, seed=0, disable_log_stats=False, additional_config=hook_cfg)
    if args.cases:
        cases = tuple((w, int(n), int(g)) for w, n, g in (c.split(":") for c in args.cases))
    cfg = json.loads((Path(model) / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    vllm_hook.register_vectors(llm, {n: torch.randn(cfg["hidden_size"], generator=g) for n in ("bench_a", "bench_b")})
    wl = workloads(cfg["num_hidden_layers"])
    vocab = llm.llm_engine.model_config.get_vocab_size()
    seed = [0]

    def batch(name: str | None, n: int, gen: int) -> float:
        seed[0] += 1                       # fresh prompts: no prefix-cache hits
        specs = [wl[name](i) if name else None for i in range(n)]
        sps = [SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True,
                              extra_args={"vllm_hook": s} if s else None) for s in specs]
        ps = [{"prompt_token_ids": p} for p in prompts(n, plen, vocab, seed[0])]
        t = time.perf_counter()
        outs = llm.generate(ps, sps, use_tqdm=False)
        for o in outs:
            if hasattr(o, "vllm_hook"):
                vllm_hook.results(o)
        return time.perf_counter() - t

    rep = io.StringIO()
    for name, n, gen in cases:
        for _ in range(3):
            batch(name, n, gen), batch(None, n, gen)
        ts: dict[str, list[float]] = {"unhooked": [], "hooked": []}
        for _ in range(4):
            ts["unhooked"].append(batch(None, n, gen))
            ts["hooked"].append(batch(name, n, gen))
        before = vllm_hook.stats(llm)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            batch(name, n, gen)
        prof.disable()
        after = vllm_hook.stats(llm)
        # per profiled batch: seconds counters in ms, counts as counts
        diff = {f"{side}.{k}": round((1e3 if k.endswith("_s") else 1) * (after[side][k] - before[side][k]) / 3, 2)
                for side in ("frontend", "timing") for k in after[side] if isinstance(after[side][k], (int, float))}
        rep.write(f"===== {name}, {n} requests, {plen} + {gen} tokens: ms per batch, unprofiled: "
                  + ", ".join(f"{k} {sorted(round(1e3 * x, 1) for x in v)}" for k, v in ts.items()) + "\n")
        rep.write(f"plugin counters per profiled batch (ms for times): {diff}\n")
        st = pstats.Stats(prof, stream=rep)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats("vllm_hook", 40)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prof.txt").write_text(rep.getvalue())
    print(rep.getvalue())


if __name__ == "__main__":
    main()
