"""Where a hooked batch's extra time goes: py-spy over one plugin engine (issue 17).

    python benchmarks/profile_batches.py --model DIR --out DIR [--served] [--batches 64x128+1 ...]
        [--workloads steer_add_all_layers ...] [--reps 6] [--py-spy PATH] [--rate 250]

One plugin engine: offline (`vllm.LLM` in the process of `throughput.py`'s engine worker) or,
with `--served`, a `vllm serve` server (the settings of `throughput_served.py`). Per batch and
workload, `--reps` hooked batches and `--reps` unhooked ones, each set sampled by py-spy in
the frontend's process (the LLM's, or the API server) and in every engine process. Writes the
raw stacks (`*.txt`, py-spy's `raw` format) and `report.md`: per process, the frames whose
samples grew most from the unhooked batches to the hooked ones, in µs a request (inclusive: a
frame with what it called). A diagnostic, not a figure of record: sampling misses short work
and waits, and `--nonblocking` sampling reads stacks as they change. Needs the py-spy binary
(`pip install py-spy`; a static binary, carried to the lent GPU as it is).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from engine_worker import prompts  # noqa: E402
from gpu_serve_check import Server, free_port, launch_command  # noqa: E402
from run import workloads  # noqa: E402
from throughput_served import KEY, VECTOR, Driver, server_args  # noqa: E402

TOP = 30
FRESH = itertools.count(1)


def frames(path: Path) -> tuple[collections.Counter, int]:
    """Inclusive samples per frame (function and file, lines dropped) of a py-spy raw file."""
    incl: collections.Counter = collections.Counter()
    total = 0
    if not path.exists():
        return incl, 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        for f in {re.sub(r":\d+\)", ")", f) for f in stack.split(";")}:
            incl[f] += int(n)
    return incl, total


def grown(hooked: Path, unhooked: Path, per_sample_us: float) -> list[tuple[float, float, float, str]]:
    """(hooked - unhooked, hooked, unhooked) µs a request per frame, largest growth first."""
    h, _ = frames(hooked)
    u, _ = frames(unhooked)
    rows = [((h[k] - u[k]) * per_sample_us, h[k] * per_sample_us, u[k] * per_sample_us, k) for k in set(h) | set(u)]
    return sorted(rows, key=lambda r: -r[0])[:TOP]


def family(pid: int) -> dict[str, int]:
    """The frontend's process and its engine processes (children, recursively)."""
    kids = []
    for c in psutil.Process(pid).children(recursive=True):
        try:
            if "python" in (c.cmdline()[:1] or [""])[0].lower() or "VLLM" in c.name() or "Engine" in c.name():
                kids.append(c.pid)
        except psutil.Error:             # gone, or not ours to read
            pass
    return {"frontend": pid, **{f"engine{i}": k for i, k in enumerate(kids)}}


class Offline:
    """`throughput.py`'s engine worker: `vllm.LLM` with the plugin, batches by its "time" op."""

    def __init__(self, args, out: Path):
        from run import model_and_base, start

        self.args = args
        model, base = model_and_base(args, max_num_seqs=256, smoke_kv_bytes=256 << 20)
        self.cfg = json.loads((Path(model) / "config.json").read_text())
        self.w, _ = start("plugin", model, {**base, "additional_config": {"vllm_hook": {"capture_pool_rows": 1 << 19}}},
                          out)
        self.w.call({"op": "register_bench_vectors", "hidden": self.cfg["hidden_size"]})
        self.pid = self.w.proc.pid

    async def batches(self, n, plen, gen, specs, reps, seed) -> list[float]:
        return self.w.call({"op": "time", "n": n, "prompt_len": plen, "max_tokens": gen, "specs": specs,
                            "reps": reps, "seed0": seed, "varied_lengths": self.args.varied_lengths}, timeout=1800)["times"]

    async def close(self) -> None:
        self.w.close()


class Served:
    """One plugin server, driven by `throughput_served.py`'s client."""

    def __init__(self, args, out: Path):
        from run import model_and_base

        self.args = args
        model = model_and_base(args, 256)[0] if args.model is None else args.model
        self.cfg = json.loads((Path(model) / "config.json").read_text())
        port = free_port()
        self.server = Server(launch_command("api-server" if args.smoke else "module", model, port, KEY,
                                            {"vllm_hook": {"capture_pool_rows": 1 << 18}}, server_args(args)),
                             out / "server.log", port)
        self.pid = self.server.proc.pid
        self.driver = None

    async def start(self) -> None:
        import torch

        self.server.wait_healthy(900)
        self.driver = Driver(self.server.url, max(int(b.split("x")[0]) for b in self.args.batches))
        await self.driver.client.register_vectors({VECTOR: torch.randn(self.cfg["hidden_size"])})

    async def batches(self, n, plen, gen, specs, reps, seed) -> list[float]:
        # Prompts new to the server every batch: a repeat would read the prefix cache
        # (`seed` is the offline worker's; it draws fresh prompts itself).
        return [await self.driver.batch(prompts(n, plen, self.cfg["vocab_size"], seed=next(FRESH),
                                                varied=self.args.varied_lengths), gen, specs or [None] * n)
                for _ in range(reps)]

    async def close(self) -> None:
        if self.driver is not None:
            await self.driver.http.aclose()
        self.server.stop()


async def profile(args, engine, out: Path) -> list[str]:
    cfg = engine.cfg
    wl = workloads(cfg["num_hidden_layers"])
    lines = []
    for b in args.batches:
        n, rest = b.split("x")
        n = int(n)
        plen, gen = (int(x) for x in rest.split("+"))
        for name in args.workloads:
            specs = [wl[name](i) for i in range(n)]
            await engine.batches(n, plen, gen, specs, 1, 7)        # warm-up
            await engine.batches(n, plen, gen, None, 1, 8)
            walls, files = {}, {}
            for variant, sp in (("hooked", specs), ("unhooked", None)):
                spies = []
                for proc, pid in family(engine.pid).items():
                    f = out / f"{b.replace('+', 'p')}-{name}-{variant}-{proc}.txt"
                    files[(variant, proc)] = f
                    spies.append(subprocess.Popen(
                        [args.py_spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw",
                         "-o", str(f), *(["--native"] if args.native else ["--nonblocking"])],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                time.sleep(1.0)          # py-spy attaches
                t = await engine.batches(n, plen, gen, sp, args.reps, 100)
                for s in spies:
                    s.send_signal(2)
                for s in spies:
                    s.wait(60)
                walls[variant] = sorted(t)[len(t) // 2]
            per_sample_us = 1e6 / args.rate / (n * args.reps)
            lines += [f"## {name}, {n} x {plen} + {gen}, {args.reps} reps", "",
                      f"Median batch: hooked {1e3 * walls['hooked']:.1f} ms, unhooked {1e3 * walls['unhooked']:.1f} ms "
                      f"({1e6 * (walls['hooked'] - walls['unhooked']) / n:.0f} µs a request).", ""]
            for proc in sorted({p for _, p in files}):
                _, th = frames(files[("hooked", proc)])
                _, tu = frames(files[("unhooked", proc)])
                lines += [f"**{proc}**: samples hooked {th}, unhooked {tu} "
                          f"({(th - tu) * per_sample_us:.0f} µs a request more)", "",
                          "| grown (µs/request) | hooked | unhooked | frame |", "|---|---|---|---|"]
                lines += [f"| {d:.1f} | {hv:.1f} | {uv:.1f} | `{k[:160]}` |"
                          for d, hv, uv, k in grown(files[("hooked", proc)], files[("unhooked", proc)], per_sample_us)]
                lines.append("")
            print("\n".join(lines), flush=True)
    return lines


async def main_async(args, out: Path) -> None:
    engine = (Served if args.served else Offline)(args, out)
    try:
        if args.served:
            await engine.start()
        lines = await profile(args, engine, out)
        (out / "report.md").write_text("\n".join([f"`{' '.join(sys.argv)}`", "", *lines]) + "\n")
    finally:
        await engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default with --smoke: the tiny Qwen2)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--served", action="store_true", help="a `vllm serve` server (default: offline `vllm.LLM`)")
    ap.add_argument("--batches", nargs="+", default=["64x128+1"])
    ap.add_argument("--workloads", nargs="+", default=["steer_add_all_layers", "capture_last_prompt_4_layers"])
    ap.add_argument("--varied-lengths", action="store_true", help="prompts of lengths spread over [P / 2, 3 P / 2)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples a second")
    ap.add_argument("--native", action="store_true", help="py-spy's --native: C and C++ frames too (CUDA calls); it pauses the "
                    "process at each sample (no --nonblocking), so batches run slower")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")))
    ap.add_argument("--shape", default="qwen2-1.5b", help="a random checkpoint of this shape when no --model")
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model")
    args = ap.parse_args()
    if not Path(args.py_spy).exists():
        sys.exit(f"py-spy not found at {args.py_spy}: pip install py-spy, or pass --py-spy PATH")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(args, out))


if __name__ == "__main__":
    main()
