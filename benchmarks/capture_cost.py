"""What a large capture adds to a request: a plain request against the same request capturing
every layer and token at the given sites, with the plugin's delivery stages
(`vllm_hook.stats` timing) per request. CPU with the built-in tiny model by default; on the
GPU, pass the benchmark checkpoint.

    python benchmarks/capture_cost.py [--multiprocess] [--repeat-prompt]                # CPU
    python3 benchmarks/capture_cost.py --model /tmp/vh_models/qwen2-1.5b --dtype bfloat16 \\
        --sites resid_post resid_pre --prompt-len 512 --profile $OUT/pc                  # GPU

Each request gets a new prompt; `--repeat-prompt` reuses one, to show what vLLM's prefix
cache does to the comparison (a capture of prompt positions skips reading the cache, a plain
request hits it). `--profile DIR` also writes profile.txt: cProfile of 5 more captures
(in-process engine only: the worker runs in this process). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import random
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the built-in tiny Qwen2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sites", nargs="+", default=["resid_post", "resid_pre", "attn_out", "mlp_out"])
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--gpu-mem", type=float, default=0.2)
    ap.add_argument("--multiprocess", action="store_true", help="engine core in its own process")
    ap.add_argument("--repeat-prompt", action="store_true")
    ap.add_argument("--profile", metavar="DIR", help="write a cProfile of 5 captures there")
    args = ap.parse_args()
    if args.profile and args.multiprocess:
        ap.error("--profile sees the worker only in an in-process engine: drop --multiprocess")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    import torch
    from vllm import LLM, SamplingParams

    import vllm_hook
    from vllm_hook.testing.tiny_models import tiny_model

    device = (dict(gpu_memory_utilization=args.gpu_mem) if torch.cuda.is_available()
              else dict(kv_cache_memory_bytes=64 << 20, enforce_eager=True))
    llm = LLM(args.model or tiny_model("qwen2"), dtype=args.dtype, max_model_len=args.prompt_len + 24,
              skip_tokenizer_init=True, max_num_batched_tokens=max(args.prompt_len + 24, 2048), seed=0,
              additional_config={"vllm_hook": {"sites": args.sites, "capture_pool_rows": 65536}}, **device)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    seeds = itertools.count()

    def prompt():
        rng = random.Random(0 if args.repeat_prompt else next(seeds))
        return [{"prompt_token_ids": [rng.randrange(10, vocab - 1) for _ in range(args.prompt_len)]}]

    plain = SamplingParams(max_tokens=1, temperature=0.0)
    capture = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": {
        "capture": [{"layers": "all", "site": s, "tokens": "all"} for s in args.sites]}})

    def one(sp) -> float:
        t = time.perf_counter()
        out = llm.generate(prompt(), sp, use_tqdm=False)
        if sp is capture:
            vllm_hook.results(out[0])
        return 1e3 * (time.perf_counter() - t)

    for _ in range(2):
        one(plain), one(capture)
    before = vllm_hook.stats(llm)
    t_plain = statistics.median(one(plain) for _ in range(args.reps))
    t_capture = statistics.median(one(capture) for _ in range(args.reps))
    after = vllm_hook.stats(llm)
    n = after["frontend"]["fetches"] - before["frontend"]["fetches"]
    stages = {k: round(1e3 * (after["frontend"][k] - before["frontend"][k]) / n, 2)
              for k in ("fetch_rpc_s", "read_s", "build_s")}
    stages.update({f"worker {k}": round(1e3 * (after["timing"][k] - before["timing"][k]) / n, 2)
                   for k in ("fetch_s", "write_s")})
    r = vllm_hook.results(llm.generate(prompt(), capture, use_tqdm=False)[0])
    mib = sum(x.numel() * x.element_size() for d in r.activations.values() for x in d.values()) / 2**20
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            one(capture)
        pr.disable()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("cumtime").print_stats(70)
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(40)
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        (Path(args.profile) / "profile.txt").write_text(text.getvalue())
    print(json.dumps({"multiprocess": args.multiprocess, "repeat_prompt": args.repeat_prompt,
                      "plain_ms": round(t_plain, 1), "capture_ms": round(t_capture, 1),
                      "captured_MiB": round(mib, 1), "delivery_ms": stages}))


if __name__ == "__main__":
    main()
