"""One vLLM engine in its own process, driven by JSON commands on stdin.

The coordinator (`run.py`) starts one of these per engine (native = plugin disabled, plugin,
plugin eager), so both stay alive and measurements can alternate between them. Protocol:
each command is one JSON line on stdin; each reply is one line `@@ {json}` on stdout (vLLM's
own log lines go to the same stream; the coordinator parses start-up figures from them).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time


def reply(obj) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def prompts(n: int, length: int, vocab: int, seed: int, varied: bool = False) -> list[list[int]]:
    """`n` random prompts of `length` tokens; `varied`: of lengths spread over [length / 2,
    3 * length / 2), as a dataset's (the same total)."""
    import random

    rng = random.Random(seed)
    lo = min(1000, vocab // 4)
    lengths = [length // 2 + (i * length) // n for i in range(n)] if varied else [length] * n
    return [[rng.randrange(lo, vocab - 1) for _ in range(k)] for k in lengths]


_PY_HOOKS: dict = {}


def python_hooks(spec):
    """Specs may name per-request Python hooks the worker builds ({"pyhooks": [[name,
    layers]]}, JSON cannot carry code): "norms" (`read_only`: each row's norm) and "scale"
    (modifying: the stream times 1.001). One object per (name, layers), as a user keeps one."""
    if not spec or "pyhooks" not in spec:
        return spec
    import vllm_hook

    def norms(ctx, h):
        ctx.saved.setdefault(f"layer{ctx.layer_idx}", []).append(h.float().norm(dim=-1))

    def scale(ctx, h):
        return h * 1.001

    hooks = []
    for name, layers in spec["pyhooks"]:
        key = (name, tuple(layers))
        if key not in _PY_HOOKS:
            _PY_HOOKS[key] = vllm_hook.Hook({"norms": norms, "scale": scale}[name], list(layers),
                                            read_only=name == "norms")
        hooks.append(_PY_HOOKS[key])
    return {**{k: v for k, v in spec.items() if k != "pyhooks"}, "hooks": spec.get("hooks", []) + hooks}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("native"):
        os.environ["VLLM_HOOK_DISABLE"] = "1"
    import torch
    from vllm import LLM, SamplingParams

    kwargs = dict(cfg["llm"])
    t0 = time.perf_counter()
    llm = LLM(cfg["model"], **kwargs)
    startup = time.perf_counter() - t0
    if cfg.get("frontend_threads"):
        torch.set_num_threads(int(cfg["frontend_threads"]))      # this (the frontend) process only
    threads = {"frontend_torch_threads": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0)),
               **{k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}}
    vocab = llm.llm_engine.model_config.get_vocab_size()
    elt = torch.tensor([], dtype=llm.llm_engine.model_config.dtype).element_size()
    hook = None
    if not cfg.get("native"):
        import vllm_hook as hook
    stats = hook.stats(llm) if hook else {}
    reply({"ready": True, "startup_s": startup, "stats": stats, "vocab": vocab, "threads": threads})

    fresh = itertools.count()
    steps: list[tuple[float, int]] = []      # (engine core's timestamp, request outputs) per step
    core = llm.llm_engine.engine_core
    get_output = core.get_output

    def timed_get_output(*a, **k):
        out = get_output(*a, **k)
        if out.outputs:
            steps.append((out.timestamp, len(out.outputs)))
        return out

    core.get_output = timed_get_output
    from vllm_hook.gc_clock import process_clock   # (importing the package patches nothing in vLLM)

    clock = process_clock()
    gc_s = [0.0]                # seconds in Python's cyclic collector during the last run

    def run(cmd):
        n, plen, gen = cmd["n"], cmd["prompt_len"], cmd["max_tokens"]
        ps = prompts(n, plen, vocab, cmd.get("seed", 0), cmd.get("varied_lengths", False))
        specs = [python_hooks(s) for s in (cmd.get("specs") or [None] * n)]
        sps = [SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True, logprobs=cmd.get("logprobs"),
                              extra_args={"vllm_hook": s} if (s and hook) else None) for s in specs]
        if cmd.get("one_params") and all(s == specs[0] for s in specs):
            sps = sps[0]        # one SamplingParams (one spec object) for every prompt, as users pass it
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        steps.clear()
        t, g = time.perf_counter(), clock.total
        if cmd.get("late_fetch") and hook:
            # the fetch sent after the call returns, as before `frontend.delivery.send_early`
            from vllm_hook.adapters import frontend as adapter
            sender, adapter._sender = adapter._sender, lambda engine_core: None
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], sps, use_tqdm=False)
        finally:
            if cmd.get("late_fetch") and hook:
                adapter._sender = sender
        nbytes = 0
        if hook:
            for o in outs:
                if hasattr(o, "vllm_hook"):
                    for per_layer in hook.results(o).activations.values():
                        nbytes += sum(x.numel() * elt for x in per_layer.values())  # as captured
        dt = time.perf_counter() - t
        gc_s[0] = clock.total - g
        return outs, dt, nbytes

    def decode_tpot(outs) -> float | None:
        """Mean over the batch of (last token - first token) / (tokens - 1), from the engine
        core's own timestamps (needs log stats on): prefill, queueing and the frontend's
        per-call work are left out."""
        per = []
        for o in outs:
            m, k = getattr(o, "metrics", None), len(o.outputs[0].token_ids)
            if m is None or k < 2 or not getattr(m, "last_token_ts", 0):
                return None
            per.append((m.last_token_ts - m.first_token_ts) / (k - 1))
        return sum(per) / len(per)

    def step_tpot() -> tuple[float | None, list | None]:
        """Median interval between consecutive engine-core steps in which every request of
        the batch produced a token (decode steps; the first, prefill, step left out). The
        timestamps are the core's own, one per step, so IPC and the frontend are left out,
        and the median ignores the occasional stalled step that moves a mean."""
        n = max((k for _, k in steps), default=0)
        gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(steps[1:]) if a[1] == n and b[1] == n)
        if not gaps:
            return None, None
        return statistics.median(gaps), [round(1e3 * gaps[int(q * (len(gaps) - 1))], 4) for q in (0.1, 0.5, 0.9)]

    def step_host_us(before: dict, after: dict, steps: str = "hooked_steps", secs: str = "step_host_s") -> float | None:
        """The plugin's own host time per hooked step (worker rank 0), µs, between two stats;
        with ("repeated_steps", "repeated_s"): per step that repeated the last routing."""
        n = after.get(steps, 0) - before.get(steps, 0)
        return 1e6 * (after.get(secs, 0) - before.get(secs, 0)) / n if n else None

    def sm_clock() -> int | None:
        """The GPU's current SM clock, MHz (NVML), where it can be read: a slow measurement
        at a low clock is the GPU's, not the engine's."""
        try:
            return torch.cuda.clock_rate() if torch.cuda.is_available() else None
        except Exception:
            return None

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "quit":
                reply({"bye": True})
                break
            if op == "time":
                times, gcs, tpots, step_tpots, spread, clocks, host_us, repeat_us, nbytes = [], [], [], [], [], [], [], [], 0
                for _ in range(cmd.get("reps", 1)):
                    before = hook.stats(llm)["timing"] if hook else None
                    # A new prompt every time: a repeated one would hit vLLM's prefix cache,
                    # and requests that capture prompt positions skip reading it (runs 1 to
                    # 16 timed cached native prefills against recomputed captures).
                    outs, dt, nbytes = run({**cmd, "seed": 1 + next(fresh)})
                    times.append(dt)
                    gcs.append(gc_s[0])
                    tpots.append(decode_tpot(outs))
                    med, pct = step_tpot()
                    step_tpots.append(med)
                    spread.append(pct)
                    clocks.append(sm_clock())
                    after = hook.stats(llm)["timing"] if hook else None
                    host_us.append(step_host_us(before, after) if hook else None)
                    repeat_us.append(step_host_us(before, after, "repeated_steps", "repeated_s") if hook else None)
                    # Dropped before the next batch, as a loop that saves each batch's results
                    # does: held, they would keep their share of the result arena, and a
                    # large capture's next batch would not fit it (run 151).
                    del outs
                reply({"times": times, "gc_s": gcs, "decode_tpot": tpots, "step_tpot": step_tpots, "capture_bytes": nbytes,
                       "step_ms_p10_p50_p90": spread, "sm_clock_mhz": clocks, "step_host_us": host_us,
                       "repeat_host_us": repeat_us})
            elif op == "outputs":
                outs, _, _ = run(cmd)
                res = []
                for o in outs:
                    item = {"tokens": list(o.outputs[0].token_ids)}
                    lps = o.outputs[0].logprobs
                    if lps:
                        item["first_logprobs"] = {str(t): v.logprob for t, v in lps[0].items()}
                    if hook and hasattr(o, "vllm_hook"):
                        r = hook.results(o)
                        path = os.path.join(cmd["save_dir"], f"{cmd['tag']}_{o.request_id}.safetensors")
                        r.save(path)
                        item["saved"] = path
                    res.append(item)
                outs = o = r = None         # as after "time": no results held into the next command
                reply({"outputs": res})
            elif op == "register_bench_vectors":
                g = torch.Generator().manual_seed(0)
                vecs = {n: torch.randn(cmd["hidden"], generator=g) for n in ("bench_a", "bench_b")}
                reply({"names": hook.register_vectors(llm, vecs)})
            elif op == "stats":
                reply({"stats": hook.stats(llm) if hook else {}})
            else:
                reply({"error": f"unknown op {op}"})
        except Exception as e:  # report and keep serving
            import traceback

            reply({"error": repr(e), "trace": traceback.format_exc()[-2000:]})


if __name__ == "__main__":
    main()
