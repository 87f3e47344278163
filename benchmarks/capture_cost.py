"""What a large capture adds to a request, on any machine (the CPU with the tiny model by
default): a plain request against the same request capturing every site, layer and token,
with the plugin's delivery stages (`vllm_hook.stats` timing) per request.

    python benchmarks/capture_cost.py [--model DIR] [--multiprocess] [--repeat-prompt]

Each request gets a new prompt; `--repeat-prompt` reuses one, to show what vLLM's prefix
cache does to the comparison (a capture of prompt positions skips reading the cache, a plain
request hits it). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time

SITES = ("resid_post", "resid_pre", "attn_out", "mlp_out")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the built-in tiny Qwen2)")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--multiprocess", action="store_true", help="engine core in its own process")
    ap.add_argument("--repeat-prompt", action="store_true")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    from vllm import LLM, SamplingParams

    import vllm_hook
    from vllm_hook.testing.tiny_models import tiny_model

    model = args.model or tiny_model("qwen2")
    llm = LLM(model, dtype="float32", max_model_len=args.prompt_len + 24, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True,
              max_num_batched_tokens=args.prompt_len + 24,
              additional_config={"vllm_hook": {"sites": list(SITES), "capture_pool_rows": 32768}})
    vocab = llm.llm_engine.model_config.get_vocab_size()
    seeds = itertools.count()

    def prompt():
        rng = random.Random(0 if args.repeat_prompt else next(seeds))
        return [{"prompt_token_ids": [rng.randrange(10, vocab - 1) for _ in range(args.prompt_len)]}]

    plain = SamplingParams(max_tokens=1, temperature=0.0)
    capture = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": {
        "capture": [{"layers": "all", "site": s, "tokens": "all"} for s in SITES]}})

    def ms(sp) -> float:
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            out = llm.generate(prompt(), sp, use_tqdm=False)
            if sp is capture:
                vllm_hook.results(out[0])
            times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times)

    for _ in range(2):
        llm.generate(prompt(), plain, use_tqdm=False)
        vllm_hook.results(llm.generate(prompt(), capture, use_tqdm=False)[0])
    before = vllm_hook.stats(llm)
    t_plain, t_capture = ms(plain), ms(capture)
    after = vllm_hook.stats(llm)
    n = after["frontend"]["fetches"] - before["frontend"]["fetches"]
    stages = {k: round(1e3 * (after["frontend"][k] - before["frontend"][k]) / n, 2)
              for k in ("fetch_rpc_s", "read_s", "build_s")}
    stages.update({f"worker {k}": round(1e3 * (after["timing"][k] - before["timing"][k]) / n, 2)
                   for k in ("fetch_s", "write_s")})
    r = vllm_hook.results(llm.generate(prompt(), capture, use_tqdm=False)[0])
    mib = sum(x.numel() * x.element_size() for d in r.activations.values() for x in d.values()) / 2**20
    print(json.dumps({"multiprocess": args.multiprocess, "repeat_prompt": args.repeat_prompt,
                      "plain_ms": round(t_plain, 1), "capture_ms": round(t_capture, 1),
                      "captured_MiB": round(mib, 1), "delivery_ms": stages}))


if __name__ == "__main__":
    main()
