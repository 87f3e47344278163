"""The served path's fetch on one AsyncLLM engine: sent as the engine step that finishes the
requests comes back (`FetchBatcher.prefetch`), or once their generators ask (issue 17).

    source scripts/gpu_env.sh && python3 benchmarks/async_fetch.py --model /tmp/vh_models/qwen2-1.5b --out $OUT/af
    python benchmarks/async_fetch.py --smoke --out /tmp/af                              # CPU, tiny

vLLM's `AsyncLLM` in this process (its engine core in a process of its own, as `vllm serve`
runs it), no HTTP: a batch's requests submitted together, timed until every request's
`vllm_hook.results()` is in hand. Each rep times three arms in an order turning round by round
on the same engine: unhooked, hooked, and hooked with the prefetch off (the fetch leaves when
the first finished request's generator asks, as before). Reports medians with 95 % bootstrap
intervals of hooked / unhooked for both hooked arms, and of one over the other.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from engine_worker import prompts  # noqa: E402
from pool import median_ci  # noqa: E402
from run import Record, bench_parser, model_and_base, run_meta, workloads  # noqa: E402

WORKLOADS = ("capture_last_prompt_4_layers",)      # no named vectors: nothing to register


async def timed(engine, ps, specs, gen: int, tag: str) -> float:
    """Seconds from submitting every request to every one's results in hand."""
    import vllm_hook
    from vllm import SamplingParams

    async def one(i, p, spec):
        sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True,
                            extra_args={"vllm_hook": spec} if spec else None)
        out = None
        async for out in engine.generate({"prompt_token_ids": p}, sp, f"{tag}-{i}"):
            pass
        if spec is not None and not vllm_hook.results(out).ok:
            raise SystemExit(f"request {i}: {vllm_hook.results(out).errors}")

    t = time.perf_counter()
    await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(zip(ps, specs))))
    return time.perf_counter() - t


async def run_case(engine, vocab: int, name: str, spec_of, n: int, plen: int, gen: int, reps: int) -> dict:
    from vllm_hook.frontend.delivery import FetchBatcher

    prefetch = FetchBatcher.prefetch
    rows = []
    for rep in range(reps):
        specs = [spec_of(i) for i in range(n)]
        arms = ["hooked", "unhooked", "late"]
        arms = arms[rep % 3:] + arms[:rep % 3]
        got = {}
        for k, arm in enumerate(arms):
            # new prompts for every batch: a repeated one would read vLLM's prefix cache
            ps = prompts(n, plen, vocab, 1000 * rep + 7 + k, True)
            if arm == "late":
                FetchBatcher.prefetch = lambda self, ids: None
            try:
                got[arm] = await timed(engine, ps, [None] * n if arm == "unhooked" else specs, gen, f"{name}-{rep}-{arm}")
            finally:
                FetchBatcher.prefetch = prefetch
        rows.append(got)
    res = {"workload": name, "n": n, "prompt_len": plen, "gen": gen, "reps": rows}
    for est, num, den in (("prefetch", "hooked", "unhooked"), ("late", "late", "unhooked"),
                          ("prefetch_over_late", "hooked", "late")):
        res[est] = median_ci([r[num] / r[den] for r in rows])
    print(f"  {name} n={n} {plen}+{gen}: " + ", ".join(f"{k} {res[k][0]:.3f} [{res[k][1]:.3f}, {res[k][2]:.3f}]"
                                                      for k in ("prefetch", "late", "prefetch_over_late")), flush=True)
    return res


def report(result: dict) -> str:
    m = result["meta"]
    lines = [f"Run {m['started']}: vLLM {m.get('vllm')}, torch {m.get('torch')}, {m.get('gpu')}; model {m['shape']}; "
             f"wall {m.get('wall_s', 0):.0f} s. AsyncLLM in one process, no HTTP. Ratios: median [95 % bootstrap "
             "interval] over reps.", "",
             "| workload | requests | prompt + generated | prefetch (hooked / unhooked) | fetch when asked "
             "| prefetch / when asked |", "|---|---|---|---|---|---|"]
    for r in result.get("cases", []):
        lines.append(f"| {r['workload']} | {r['n']} | {r['prompt_len']} + {r['gen']} | " + " | ".join(
            f"{r[k][0]:.3f} [{r[k][1]:.3f}, {r[k][2]:.3f}]" for k in ("prefetch", "late", "prefetch_over_late")) + " |")
    return "\n".join(lines) + "\n"


async def main_async(args, model: str, base: dict, cfg: dict) -> None:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    wl = workloads(cfg["num_hidden_layers"])
    result = Record(Path(args.out), run_meta(model, cfg), render=report, cases=[])
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, **{**base, "skip_tokenizer_init": True},
        additional_config={"vllm_hook": {"capture_pool_rows": 1 << 19}}))
    try:
        vocab = cfg["vocab_size"]
        for b in args.batches:
            n, rest = b.split("x")
            plen, gen = (int(x) for x in rest.split("+"))
            for name in args.workloads:
                # one untimed batch first: the first fetch maps the worker's arena
                await timed(engine, prompts(int(n), plen, vocab, 1, True), [wl[name](i) for i in range(int(n))],
                            gen, f"warm-{b}-{name}")
                result["cases"].append(await run_case(engine, vocab, name, wl[name], int(n), plen, gen, args.reps))
                result.save()
    finally:
        engine.shutdown()
        result.save()
    print(report(result))


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--batches", nargs="+", default=["64x128+1", "64x128+16"], help="NxPROMPT+GEN")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--gpu-mem", type=float, default=0.35)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny batches")
    args = ap.parse_args()
    model, base = model_and_base(args, max_num_seqs=256, smoke_kv_bytes=256 << 20)
    if args.smoke:
        args.batches, args.reps = ["8x16+1"], min(args.reps, 2)
    cfg = json.loads((Path(model) / "config.json").read_text())
    asyncio.run(main_async(args, model, base, cfg))


if __name__ == "__main__":
    main()
