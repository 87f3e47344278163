"""`vllm-hook extract` against plain `llm.generate` of the same prompts: one engine, one run.

    python benchmarks/extract_speed.py --smoke --out /tmp/xs                             # CPU, tiny
    source scripts/gpu_env.sh && python3 benchmarks/extract_speed.py --out $OUT/extract  # H200

Each rep times, in alternating order on one plugin engine, `llm.generate` of N token-id
prompts (1 generated token, in batches of --batch-size prompts, outputs dropped) and
`vllm_hook.extract.extract` of the same prompts from a JSONL file into shards on --scratch
(everything a user waits for: reading the input, the engine, results, shard files, manifest).
Reports prompt tokens per second of both, their ratio (median [95 % bootstrap interval]) and
the bytes written.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from pool import median_ci  # noqa: E402
from run import Record, bench_parser, model_and_base, run_meta  # noqa: E402


def jobs(L: int) -> dict:
    four = sorted({L // 4, L // 2, (3 * L) // 4, L - 1})
    return {"last_prompt_4_layers": dict(layers=four, tokens="last_prompt", dtype="float32"),
            "all_tokens_4_layers_bf16": dict(layers=four, tokens="all", dtype="model"),
            "all_tokens_all_layers_bf16": dict(layers="all", tokens="all", dtype="model")}


def report(result: dict) -> str:
    m = result["meta"]
    lines = [f"Run {m['started']}: vLLM {m.get('vllm')}, torch {m.get('torch')}, {m.get('gpu')}; model {m['shape']}; "
             f"{m['n']} prompts x {m['prompt_len']} tokens, batches of {m['batch_size']}; wall {m.get('wall_s', 0):.0f} s.",
             "", "| job | plain generate (tok/s) | extract (tok/s) | extract / plain time | written |",
             "|---|---|---|---|---|"]
    for r in result["cases"]:
        ci = r["ratio"]
        lines.append(f"| {r['job']} | {r['plain_tok_s']:,.0f} | {r['extract_tok_s']:,.0f} | {ci[0]:.3f} "
                     f"[{ci[1]:.3f}, {ci[2]:.3f}] | {r['bytes'] / 2**20:,.1f} MiB |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--scratch", default=tempfile.gettempdir(), help="where the datasets are written")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--jobs", nargs="+", default=["last_prompt_4_layers", "all_tokens_4_layers_bf16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small job")
    args = ap.parse_args()
    model, base = model_and_base(args, max_num_seqs=256, smoke_kv_bytes=256 << 20)
    if args.smoke:
        base["enforce_eager"] = True
        args.n, args.prompt_len, args.batch_size, args.reps = 256, 32, 64, 8
    cfg = json.loads((Path(model) / "config.json").read_text())
    from vllm import LLM, SamplingParams

    from vllm_hook.extract import Job, OfflineEngine, extract

    rnd = random.Random(0)
    vocab = cfg["vocab_size"]
    prompts = [[rnd.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.n)]
    scratch = Path(tempfile.mkdtemp(prefix="vh_extract_", dir=args.scratch))
    src = scratch / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    result = Record(Path(args.out), run_meta(model, cfg, n=args.n, prompt_len=args.prompt_len,
                                             batch_size=args.batch_size), render=report, cases=[])
    llm = LLM(model, **base, additional_config={"vllm_hook": {"capture_pool_rows": 1 << 17}})
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def plain() -> float:
        t = time.perf_counter()
        for i in range(0, args.n, args.batch_size):
            llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + args.batch_size]], params, use_tqdm=False)
        return time.perf_counter() - t

    def extracted(job: Job) -> tuple[float, int]:
        d = scratch / "out"
        shutil.rmtree(d, ignore_errors=True)
        t = time.perf_counter()
        m = extract(OfflineEngine(llm), job, d, batch_size=args.batch_size, progress=False)
        dt = time.perf_counter() - t
        size = sum(os.path.getsize(d / s.file) for s in m.shards)
        shutil.rmtree(d, ignore_errors=True)
        return dt, size

    try:
        plain()                                 # warm-up: graphs, allocator, caches
        all_jobs = jobs(cfg["num_hidden_layers"])
        for name in args.jobs:
            job = Job(model=model, input=str(src), shard_rows=65536, **all_jobs[name])
            extracted(job)
            rows = []
            for rep in range(args.reps):
                if rep % 2:
                    tp, (te, size) = plain(), extracted(job)
                else:
                    (te, size), tp = extracted(job), plain()
                rows.append({"plain_s": tp, "extract_s": te, "bytes": size})
            toks = args.n * args.prompt_len
            case = {"job": name, "reps": rows, "bytes": rows[0]["bytes"],
                    "ratio": median_ci([r["extract_s"] / r["plain_s"] for r in rows]),
                    "plain_tok_s": toks / min(r["plain_s"] for r in rows),
                    "extract_tok_s": toks / min(r["extract_s"] for r in rows)}
            result["cases"].append(case)
            print(f"  {name}: plain {case['plain_tok_s']:,.0f} tok/s, extract {case['extract_tok_s']:,.0f} "
                  f"tok/s, ratio {case['ratio'][0]:.3f}, {case['bytes'] / 2**20:.0f} MiB", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        result.save()
    print(report(result))


if __name__ == "__main__":
    main()
