"""Where the time of a large capture goes: one in-process engine (the worker runs in this
process, so one host profile sees the frontend and the worker), a 512-token prompt with every
layer and token captured, under cProfile.

    python benchmarks/profile_capture.py --model DIR --out DIR

Writes times.json (wall times: no spec, capture in float32, capture in the model dtype; and the
plugin's delivery timing counters) and profile.txt (cumulative and own time per function over
5 captures).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gpu-mem", type=float, default=0.2)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    import vllm_hook

    llm = LLM(args.model, dtype="bfloat16", max_model_len=min(4096, 2 * args.prompt_len), max_num_seqs=64,
              skip_tokenizer_init=True, gpu_memory_utilization=args.gpu_mem, seed=0,
              additional_config={"vllm_hook": {"capture_pool_rows": 65536}})
    rng = random.Random(0)
    prompt = [{"prompt_token_ids": [rng.randrange(100, 50000) for _ in range(args.prompt_len)]}]
    spec = {"capture": [{"layers": "all", "tokens": "all"}]}

    def one(s) -> float:
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                            extra_args={"vllm_hook": s} if s else None)
        t = time.perf_counter()
        out = llm.generate(prompt, sp, use_tqdm=False)
        if s:
            vllm_hook.results(out[0])
        return time.perf_counter() - t

    for _ in range(3):
        one(spec), one(None)
    times = {"no spec": [], "capture float32": [], "capture model dtype": []}
    for _ in range(7):
        times["no spec"].append(one(None))
        times["capture float32"].append(one(spec))
        times["capture model dtype"].append(one({**spec, "dtype": "model"}))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        one(spec)
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("cumtime").print_stats(70)
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(40)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.txt").write_text(text.getvalue())
    summary = {k: {"min_ms": 1e3 * min(v), "median_ms": 1e3 * sorted(v)[len(v) // 2]} for k, v in times.items()}
    st = vllm_hook.stats(llm)
    summary["delivery_timing_s"] = {"worker": st.get("timing"), "frontend": st.get("frontend")}
    (out / "times.json").write_text(json.dumps({"summary": summary, "times_s": times}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
