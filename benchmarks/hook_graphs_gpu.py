"""The worker's read-only hook path on the GPU, without an engine: the built-in logit lens at
4 layers of a Qwen2-1.5B-shaped model over 16 / 64 requests, steady decode steps run eagerly
or replayed from the hooks' own CUDA graph (`worker/hook_graphs.py`). Reports host µs and
device µs per step of the hooks alone, and whether both ways saved equal results.

    source scripts/gpu_env.sh && python3 benchmarks/hook_graphs_gpu.py --out $OUT/hg

(vllm_hook imports vLLM: run it with the kit.) Writes results.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from vllm_hook.config import HookConfig  # noqa: E402
from vllm_hook.hooks import kernels  # noqa: E402
from vllm_hook.hooks.builtin import logit_lens  # noqa: E402
from vllm_hook.worker.hooks import WorkerHooks  # noqa: E402


class Access:
    """What a hook's ctx reads: `lm_head.weight` and the final norm (random, bf16)."""

    def __init__(self, hidden: int, vocab: int):
        self.w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        self.nw = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)

    def __call__(self, name):
        return self.w

    def final_norm(self, h):
        return kernels.rms_norm(h, self.nw, 1e-6)


def run(access: Access, n: int, graphs: bool, steps: int, layers: list[int], num_layers: int, hidden: int) -> dict:
    cfg = HookConfig(hook_layers=layers, hook_graphs=graphs)
    wh = WorkerHooks(access, num_layers, {x + 1 for x in layers}, cfg, 1e4)
    wh.copies = {x + 1: torch.empty(256, hidden, device="cuda", dtype=torch.bfloat16) for x in layers}
    wh._built["d"] = logit_lens(layers, 5)
    reqs = [wh.for_request(f"r{i}", 128, [{"i": 0, "digest": "d"}], []) for i in range(n)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    host, dev = [], []
    for k in range(steps):
        for cp in wh.copies.values():          # what the forward's read-only twin copies
            cp.normal_(generator=gen)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        if not wh.advance():
            wh.plan([(r, i, 1, 128 + k) for i, r in enumerate(reqs)])
        wh.run_copies()
        wh.clear_plan()
        b.record()
        host.append(time.perf_counter() - t)
        dev.append((a, b))
    torch.cuda.synchronize()
    steady = slice(steps // 2, None)          # past the capture
    return {"host_us": 1e6 * statistics.median(host[steady]),
            "device_us": 1e3 * statistics.median(a.elapsed_time(b) for a, b in dev[steady]),
            "first_steps_host_us": [round(1e6 * x) for x in host[:8]],
            "timing": {k: v for k, v in wh.timing.items() if k.startswith("graph")},
            "saved": [{k: [t.clone() for t in v] for k, v in r.spec[0].ctx.saved.items()} for r in reqs]}


def compare(access: Access, n: int, args, layers: list[int]) -> dict:
    got = {}
    for graphs in (False, True, False, True):     # twice each: the first warms
        got[graphs] = run(access, n, graphs, args.steps, layers, args.num_layers, args.hidden)
    e, g = got[False], got[True]
    pairs = [(re[k], rg[k]) for re, rg in zip(e["saved"], g["saved"]) for k in re]
    equal = all(len(a) == len(b) == args.steps and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in pairs)
    print(f"{n} requests: eager {e['host_us']:.0f} µs host / {e['device_us']:.0f} µs device per step; "
          f"graph {g['host_us']:.0f} / {g['device_us']:.0f}; results equal: {equal}; {g['timing']}", flush=True)
    return {"eager": {k: v for k, v in e.items() if k != "saved"},
            "graph": {k: v for k, v in g.items() if k != "saved"}, "results_equal": equal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--num-layers", type=int, default=28)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    L = args.num_layers
    layers = [L // 4 - 1, L // 2 - 1, 3 * L // 4 - 1, L - 1]
    access = Access(args.hidden, args.vocab)
    kernels.warm(torch.device("cuda"), torch.bfloat16, args.hidden, args.vocab)
    res = {}
    with torch.inference_mode():
        for n in args.batches:
            try:
                res[n] = compare(access, n, args, layers)
            except Exception as e:             # report, and go on to the next batch
                import traceback

                traceback.print_exc()
                res[n] = {"error": repr(e)}
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "layers": layers,
            "hidden": args.hidden, "vocab": args.vocab, "steps": args.steps}
    (out / "results.json").write_text(json.dumps({"meta": meta, "batches": res}, indent=1))


if __name__ == "__main__":
    main()
