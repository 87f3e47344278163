"""GPU time of the logit lens's kernels, and what running them on a side stream saves.

    python3 benchmarks/lens_gpu.py --out $OUT/lens     (torch only: no vLLM needed)

Two questions about the built-in `logit_lens` hook at a decode step (issue 16):
1. How long its kernels take on the device (final norm, the product with `lm_head`, top-k
   and log-sum-exp) for the rows of 4 layers x 16 / 64 requests, per variant of the top-k.
2. How much of that a side stream hides behind the next step's kernels: a
   stand-in decode step (a Qwen2-1.5B-shaped stack of matmuls at the batch's rows, replayed
   as one CUDA graph) followed by the lens on the same stream, or on a side stream that
   overlaps the next replay.
Writes results.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parent.parent / "src"


def load_builtin():
    """hooks/builtin.py without the package's __init__ (which imports vLLM)."""
    for name, path in (("vllm_hook", SRC / "vllm_hook"), ("vllm_hook.hooks", SRC / "vllm_hook" / "hooks")):
        m = types.ModuleType(name)
        m.__path__ = [str(path)]
        sys.modules[name] = m
    reg = types.ModuleType("vllm_hook.hooks.registry")
    reg.operator_hook = lambda name: (lambda f: f)
    sys.modules["vllm_hook.hooks.registry"] = reg
    import vllm_hook.hooks.builtin as b
    import vllm_hook.hooks.kernels as tk
    return b, tk


def device_ms(body, iters: int, finish=None) -> tuple[float, float]:
    """(device ms per iteration, host µs per iteration) of `iters` calls of `body`; `finish`
    (e.g. joining a side stream) runs before the end is recorded."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    a.record()
    for _ in range(iters):
        body()
    if finish is not None:
        finish()
    b.record()
    host = (time.perf_counter() - t) / iters * 1e6
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters, host


def gpu_ms(fn, iters: int = 50) -> tuple[float, float]:
    """(device ms per call, host µs per call to launch it)."""
    for _ in range(5):
        fn()
    return device_ms(fn, iters)


def graph_ms(fn, iters: int = 50) -> float:
    """Device time per call, replayed from a CUDA graph (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    return device_ms(g.replay, iters)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--inter", type=int, default=8960)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tune-only", action="store_true", help="only the top-k kernels' knobs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b, tk = load_builtin()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    H, V = args.hidden, args.vocab
    w = (torch.randn(V, H, device=dev, dtype=dt, generator=g) * 0.02)
    nw = torch.ones(H, device=dev, dtype=dt)

    avail = tk.available

    def torch_only(fn):
        tk.available = lambda *a: False
        try:
            return fn()
        finally:
            tk.available = avail

    def norm_torch(x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y.to(dt) * nw

    def norm(x):      # what the engine uses on a GPU (adapters/params.py)
        return tk.rms_norm(x, nw, 1e-6)

    res: dict = {}
    # What a worker with hook layers does at start (hooks/kernels.py: warm), then the first
    # calls at the lens's shapes: they should find the kernels built.
    t = time.perf_counter()
    tk.warm(dev, dt, H, V)
    torch.cuda.synchronize()
    res["warm_s"] = round(time.perf_counter() - t, 3)
    x0 = torch.randn(4 * args.batches[-1], H, device=dev, dtype=dt, generator=g)
    t = time.perf_counter()
    b._lens(norm(x0), w, 5)
    torch.cuda.synchronize()
    res["first_lens_call_after_warm_s"] = round(time.perf_counter() - t, 4)
    print("warm", res["warm_s"], "s; first lens call after it", res["first_lens_call_after_warm_s"], "s", flush=True)
    for n in args.batches:
        # The top-k kernels' knobs, by device time alone (graph replays).
        lg = torch.randn(4 * n, V, device=dev, dtype=dt, generator=g)
        ref_ids = lg.float().log_softmax(-1).topk(5, -1).indices
        for block in (2048, 4096, 8192, 16384):
            for warps in ((4, 4), (8, 4), (8, 8), (16, 8)):
                ids, _ = tk.topk_logprobs(lg, 5, block=block, warps=warps)
                ok = bool((lg.gather(1, ids) == lg.gather(1, ref_ids)).all())
                ms = graph_ms(lambda: tk.topk_logprobs(lg, 5, block=block, warps=warps))
                res[f"{n}:tune:{block}:{warps[0]}:{warps[1]}"] = {"gpu_us": round(ms * 1e3, 1), "ok": ok}
                print(f"{n:4d} tune block {block:6d} warps {warps}  {ms * 1e3:7.1f} us  ok={ok}", flush=True)
        for name, fn in (("torch chunked", lambda: torch_only(lambda: b.topk_logprobs(lg, 5))),
                         ("linear", lambda: torch.nn.functional.linear(lg[:, :H], w)),
                         ("norm triton", lambda: norm(lg[:, :H].contiguous()))):
            ms = graph_ms(fn)
            res[f"{n}:graph:{name}"] = {"gpu_us": round(ms * 1e3, 1)}
            print(f"{n:4d} graph {name:20s} {ms * 1e3:7.1f} us", flush=True)
        if args.tune_only:
            continue
        rows = 4 * n
        x = torch.randn(rows, H, device=dev, dtype=dt, generator=g)
        logits = torch.nn.functional.linear(norm(x), w)
        t = time.perf_counter()
        ids, lps = tk.topk_logprobs(logits, 5)
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        ref = logits.float().log_softmax(-1).topk(5, -1)
        same = (ids == ref.indices) | (logits.gather(1, ids) == logits.gather(1, ref.indices))     # ties
        nt, nr = norm(x).float(), norm_torch(x).float()
        res[f"{n}:triton_parity"] = {"first_call_s": round(first, 3), "ids_equal_or_tied": bool(same.all()),
                                     "max_abs_logprob_diff": float((lps - ref.values).abs().max()),
                                     "norm_elements_differing": int((nt != nr).sum()), "norm_elements": nt.numel(),
                                     "norm_max_rel_diff": float(((nt - nr).abs() / nr.abs().clamp_min(1e-3)).max())}
        print(n, res[f"{n}:triton_parity"], flush=True)
        variants = {
            "norm (torch)": lambda: norm_torch(x),
            "norm (triton)": lambda: norm(x),
            "linear": lambda: torch.nn.functional.linear(x, w),
            "topk_chunked torch (no linear)": lambda: torch_only(lambda: b.topk_logprobs(logits, 5)),
            "topk_plain (log_softmax + topk)": lambda: b.topk_logprobs(logits, 5, chunks=1),
            "topk_bf16 + logsumexp": lambda: (logits.topk(5, -1), torch.logsumexp(logits.float(), -1)),
            "topk_triton (no linear)": lambda: tk.topk_logprobs(logits, 5),
            "lens (norm + linear + chunked torch)": lambda: torch_only(lambda: b._lens(norm_torch(x), w, 5)),
            "lens (norm + linear + triton)": lambda: b._lens(norm(x), w, 5),
        }
        for name, fn in variants.items():
            ms, host = gpu_ms(fn)
            res[f"{n}:{name}"] = {"rows": rows, "gpu_ms": round(ms, 4), "host_us": round(host, 1)}
            print(f"{n:4d} {rows:5d}  {name:45s} {ms:8.4f} ms  host {host:7.1f} us", flush=True)

        # A stand-in decode step: per layer qkv, o, gate_up, down at n rows, as one graph.
        Ws = [[torch.randn(o, i, device=dev, dtype=dt, generator=g) * 0.02
               for o, i in ((H + 512, H), (H, H), (2 * args.inter, H), (H, args.inter))] for _ in range(args.layers)]
        h0 = torch.randn(n, H, device=dev, dtype=dt, generator=g)
        copies = torch.empty(4, n, H, device=dev, dtype=dt)

        def step():
            h = h0
            for L, (qkv, o, gu, d) in enumerate(Ws):
                a = torch.nn.functional.linear(h, qkv)[:, :H]
                h = h + torch.nn.functional.linear(a, o)
                u = torch.nn.functional.linear(h, gu)
                h = h + torch.nn.functional.linear(torch.nn.functional.silu(u[:, :args.inter]) * u[:, args.inter:], d)
                if L in (4, 9, 14, 26):
                    copies[(4, 9, 14, 26).index(L)].copy_(h)
            torch.nn.functional.linear(norm_torch(h), w).argmax(-1)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        side = torch.cuda.Stream()          # default priority: vLLM's own stream has the same
        main = torch.cuda.current_stream()

        def lens_on(stream, triton=True):
            x = copies.view(4 * n, H).clone()
            if not triton:
                torch_only(lambda: b._lens(norm_torch(x), w, 5))
            elif stream is not None:
                ev = torch.cuda.Event()
                ev.record(main)
                stream.wait_event(ev)
                with torch.cuda.stream(stream):
                    x.record_stream(stream)
                    b._lens(norm(x), w, 5)
            else:
                b._lens(norm(x), w, 5)

        def loop(mode, steps=40):
            def one():
                graph.replay()
                if mode == "same_torch":
                    lens_on(None, triton=False)
                elif mode == "same":
                    lens_on(None)
                elif mode == "side":
                    lens_on(side)          # on a clone of the copies: it may overlap the next replay

            graph.replay()
            return device_ms(one, steps, finish=lambda: main.wait_stream(side))[0]

        for mode in ("none", "same_torch", "same", "side", "none"):
            ts = [loop(mode) for _ in range(5)]
            key = f"{n}:step+lens:{mode}"
            res[key] = {"ms_per_step": round(statistics.median(ts), 4)}
            print(f"{n:4d} step + lens {mode:10s} {statistics.median(ts):8.4f} ms/step", flush=True)
        Ws = graph = None      # free the stand-in before the next batch size
        torch.cuda.empty_cache()
    res["device"] = torch.cuda.get_device_name()
    (out / "results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
