"""The API server's CPU time per served request, plain and hooked, on this machine (issue 17).

    python benchmarks/api_server_cpu.py [--requests 1500] [--rounds 4] [--workloads ...] [--out DIR]

A served batch's requests reach and leave one API server event loop together, so what the
plugin adds there per request is paid serially (docs/benchmarks.md, runs 129 to 131). This
measures it where GPU time is not needed: one `vllm serve` of the tiny 28-layer Qwen2 (CPU,
eager), `--requests` completions per round (32-token prompts, `--max-tokens` generated, default 1,
`--in-flight` at a time, default 16, or with `--batches` in batches of that many sent at once
and awaited together, as a GPU batch's requests arrive and finish; `vllm_hook.AsyncClient`), rounds of each workload alternating with plain ones, each
round's CPU time per request read from the API server's event-loop thread (its main thread)
and from the whole process (the kernel's clock ticks: 10 ms over a round, 7 µs a request
at 1,500). Reports medians over rounds and the hooked workload's extra over the plain rounds.
A diagnostic of this machine's figures, not a GPU figure of record; `--py-spy PATH` records
each round's stacks for attribution.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "src", HERE.parent / "scripts"):
    sys.path.insert(0, str(p))

import httpx  # noqa: E402
import psutil  # noqa: E402

from engine_worker import prompts  # noqa: E402
from gpu_serve_check import Server, free_port, launch_command  # noqa: E402
from run import workloads  # noqa: E402
from throughput_served import KEY, VECTOR, server_args  # noqa: E402
from vllm_hook.client import AsyncClient  # noqa: E402

def clocks(proc: psutil.Process) -> tuple[float, float]:
    """CPU seconds of the process's main thread (the event loop) and of the whole process."""
    t = proc.cpu_times()
    main = next((th.user_time + th.system_time for th in proc.threads() if th.id == proc.pid), 0.0)
    return main, t.user + t.system


async def one_round(client: AsyncClient, proc: psutil.Process, spec_of, n: int, seed: int,
                    in_flight: int, batches: bool = False, max_tokens: int = 1) -> dict:
    ps = prompts(n, 32, 512, seed=seed)
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int):
        async with gate:
            g = await client.generate(ps[i], spec_of(i) if spec_of else None, max_tokens=max_tokens,
                                      temperature=0.0, ignore_eos=True)
            if spec_of and (g.results is None or not g.results.ok):
                raise RuntimeError(f"request failed: {g.results and g.results.errors}")

    c0, t0, w0 = clocks(proc), time.process_time(), time.perf_counter()
    step = in_flight if batches else n
    for start in range(0, n, step):
        await asyncio.gather(*(one(i) for i in range(start, min(start + step, n))))
    c1, t1, w1 = clocks(proc), time.process_time(), time.perf_counter()
    return {"loop_us": 1e6 * (c1[0] - c0[0]) / n, "process_us": 1e6 * (c1[1] - c0[1]) / n,
            "client_us": 1e6 * (t1 - t0) / n, "wall_s": w1 - w0}


async def bench(args, url: str, pid: int, out: Path) -> dict:
    import torch

    http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600,
                             limits=httpx.Limits(max_connections=args.in_flight + 8, max_keepalive_connections=0))
    client = AsyncClient(url, http=http)
    await client.register_vectors({VECTOR: torch.randn(128)})
    proc, wl = psutil.Process(pid), workloads(28)
    rounds: dict[str, list[dict]] = {}
    seed = 1
    await one_round(client, proc, None, 64, seed, args.in_flight)            # warm-up
    for r in range(args.rounds):
        for name in ["plain", *args.workloads][::1 if r % 2 == 0 else -1]:
            seed += 1
            spy = None
            if args.py_spy:
                spy = subprocess.Popen([args.py_spy, "record", "--pid", str(pid), "--rate", "500", "--format", "raw",
                                        "--nonblocking", "-o", str(out / f"{name}-{r}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            got = await one_round(client, proc, None if name == "plain" else wl[name], args.requests, seed,
                                  args.in_flight, args.batches, args.max_tokens)
            if spy is not None:
                spy.send_signal(2)
                spy.wait()
            rounds.setdefault(name, []).append(got)
            print(f"  round {r} {name:30s} loop {got['loop_us']:6.0f} µs  process {got['process_us']:6.0f}  "
                  f"client {got['client_us']:6.0f}  ({got['wall_s']:.1f} s)", flush=True)
    await http.aclose()
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("loop_us", "process_us", "client_us")}
           for name, rs in rounds.items()}
    return {"rounds": rounds, "median": med,
            "extra": {name: {k: m[k] - med["plain"][k] for k in m} for name, m in med.items() if name != "plain"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--in-flight", type=int, default=16, help="requests sent at once")
    ap.add_argument("--batches", action="store_true", help="send --in-flight requests at a time, each batch awaited")
    ap.add_argument("--workloads", nargs="+", default=["steer_add_all_layers"])
    ap.add_argument("--max-tokens", type=int, default=1,
                    help="tokens generated a request (above 1, a capture complete at its prompt is fetched "
                         "while its request decodes, as on a GPU at 128)")
    ap.add_argument("--out", default="/tmp/api_server_cpu")
    ap.add_argument("--py-spy", help="path of the py-spy binary: record each round's stacks")
    args = ap.parse_args()
    from vllm_hook.testing.tiny_models import tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_model("qwen2", layers=28)
    port = free_port()
    smoke = argparse.Namespace(smoke=True)
    srv = Server(launch_command("api-server", model, port, KEY, {"vllm_hook": {}}, server_args(smoke)),
                 out / "server.log", port, env={})
    try:
        srv.wait_healthy(900)
        result = asyncio.run(bench(args, srv.url, srv.proc.pid, out))
    finally:
        srv.stop()
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print("\nmedian µs a request (API server event loop / whole API process / client), and over plain:")
    for name, m in result["median"].items():
        e = result["extra"].get(name)
        print(f"  {name:30s} {m['loop_us']:6.0f} / {m['process_us']:6.0f} / {m['client_us']:6.0f}"
              + (f"   +{e['loop_us']:.0f} / +{e['process_us']:.0f} / +{e['client_us']:.0f}" if e else ""))


if __name__ == "__main__":
    main()
