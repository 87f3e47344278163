"""End-to-end throughput of `vllm serve` at 64 and 256 concurrent requests (issue 17): a native
server and a vllm-hook server, one run.

    source scripts/gpu_env.sh && python3 benchmarks/throughput_served.py --out $OUT/tps    # H200
    python benchmarks/throughput_served.py --smoke --out /tmp/tps                          # CPU, tiny

N clients at once (one asyncio task each, `vllm_hook.AsyncClient` over one HTTP connection pool)
each send one completion of a token-id prompt. Timed from the first request sent to the last
response's results decoded (`Generation.results`): what a served user waits for. Each rep times
native, plugin, native, plugin: the native server (`VLLM_HOOK_DISABLE=1`) twice, its mean
taken, and the plugin server with the workload's specs and without, hooked first on even reps,
unhooked first on odd ones, so that no server serves two batches in a row (that batch is slower
whichever server it is). Every batch has prompts of its own: a repeat would read the prefix
cache an earlier batch wrote. The in-engine ratio is hooked over unhooked on one server.
The client process's heap (torch, httpx, the benchmark) is frozen out of Python's cyclic
collector once set up (`gc.freeze`): a full collection of it took 70 to 100 ms on the CI
machine, about one batch in two whichever server it timed, as much as a 256-request batch's
whole plugin cost on a GPU (`--no-gc-freeze` keeps it; the client's collector time per batch
is reported either way).
Each batch's CPU time is read from the server's processes (its API server; its engine core
and workers) and the client's: the hooked batch's over the unhooked one's, per request, counts
the plugin's work wherever and whenever it ran, which wall-clock ratios on a noisy host cannot.
`--control` starts a second native server for the second native slot: its ratio to the first
is the floor of what two servers on one machine differ by.
The servers run at once (started one after another), each with its share of GPU memory, and
only one is sent requests at a time. Results are inline up to --inline-bytes (default: the
plugin's), larger ones by handle: the client, on the server's host, reads each from its file
and releases a response's in one call (`local_results`, docs/serve.md); with
`--deliveries http` it fetches and deletes each over HTTP in one round trip, as a client on
another host does; `--deliveries files http` times each workload both ways on the same servers
(a client of each kind; one server start; the two take turns at going first, batch size by
batch size).
The client keeps no connection alive (`--client-limits async-client`: `vllm_hook.AsyncClient`'s
own pool, 20 kept). "MB / extra s" is the hooked batch's activation bytes over its median extra
time: the bandwidth at which moving the results alone would explain the extra.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "src", HERE.parent / "scripts"):
    sys.path.insert(0, str(p))

import httpx  # noqa: E402
import psutil  # noqa: E402

from engine_worker import prompts  # noqa: E402
from vllm_hook.gc_clock import process_clock  # noqa: E402
from gpu_serve_check import Server, free_port, launch_command  # noqa: E402
from pool import median_ci  # noqa: E402
from run import Record, bench_parser, host_line, run_meta, workloads  # noqa: E402
from throughput import STAGES, verdict  # noqa: E402
from vllm_hook.client import ASYNC_LIMITS, AsyncClient  # noqa: E402

KEY = "bench-key"
VECTOR = "bench_a"
SERVED_STAGES = {**STAGES, "frontend.read_ahead_s": "read, build, encode ahead (fetched while decoding)",
                 "frontend.encode_s": "encode (safetensors; inline or a handle)"}


def server_args(args) -> list[str]:
    """vLLM's flags for both servers: the offline benchmark's engine settings."""
    if args.smoke:
        return ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0", "--max-num-seqs", "256",
                "--skip-tokenizer-init"]
    return ["--dtype", "bfloat16", "--max-model-len", "4096", "--gpu-memory-utilization", str(args.gpu_mem),
            "--max-num-seqs", "256", "--seed", "0", "--skip-tokenizer-init"]


def start_servers(args, model: str, out: Path) -> dict[str, Server]:
    launcher = "api-server" if args.smoke else "module"
    servers = {}
    native = [("native", {"VLLM_HOOK_DISABLE": "1"}, None)]
    if args.control:
        native.append(("native_b", {"VLLM_HOOK_DISABLE": "1"}, None))
    for name, env, config in (*native,
                              ("plugin", {}, {"vllm_hook": {"capture_pool_rows": 1 << 18, **(
                                  {} if args.inline_bytes is None else {"max_inline_result_bytes": args.inline_bytes})}})):
        port = free_port()
        cmd = launch_command(launcher, model, port, KEY, config, server_args(args))
        # One at a time: vLLM sizes its KV cache from the GPU memory that moved while it
        # profiled, so another server allocating meanwhile can leave it none (a third server
        # started alongside failed so on the H200).
        t = time.monotonic()
        servers[name] = Server(cmd, out / f"server-{name}.log", port, env=env)
        try:
            servers[name].wait_healthy(args.start_timeout)
        except BaseException:
            for s in servers.values():
                s.stop()
            raise
        print(f"[{name}] healthy after {time.monotonic() - t:.0f} s", flush=True)
    return servers


FRESH = itertools.count(1)   # a seed per batch: every batch's prompts are new to every server
GC = process_clock()     # the client's seconds in Python's cyclic collector


class Driver:
    """One server's client: a connection pool large enough for every request of a batch."""

    def __init__(self, url: str, max_requests: int, client_limits: str = "none-kept", pid: int | None = None,
                 local_results: bool = True):
        # No keep-alive: httpx's pool slows down as it fills with idle connections (encode/httpx
        # #3215). Reusing them, a batch of 128 took 2.8 s on the CI machine's tiny server against
        # 1.45 s on fresh connections and 0.8 s with none kept; on the H200 it is the likely cause
        # of a server's batch right after its own previous one taking 1.4 to 1.8x as long (run
        # 80). Connections to a local server cost little to open.
        # `--client-limits async-client`: vllm_hook.AsyncClient's own (what a user gets).
        limits = (ASYNC_LIMITS if client_limits == "async-client"
                  else httpx.Limits(max_connections=max_requests + 8, max_keepalive_connections=0))
        self.http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                      timeout=1800, limits=limits)
        self.client = AsyncClient(url, http=self.http, local_results=local_results)
        self.delivered = 0      # bytes of activations in the last batch's results
        self.gc_s = 0.0         # the client's seconds in Python's collector during the last batch
        # CPU seconds of the last batch: the server's API process, its engine processes, this client
        self.server = psutil.Process(pid) if pid is not None else None
        self.cpu_s = (0.0, 0.0, 0.0)

    def _cpu(self) -> tuple[float, float, float]:
        if self.server is None:
            return 0.0, 0.0, time.process_time()
        api = self.server.cpu_times()
        engine = 0.0
        for p in self.server.children(recursive=True):
            try:
                c = p.cpu_times()
                engine += c.user + c.system
            except psutil.NoSuchProcess:
                pass
        return api.user + api.system, engine, time.process_time()

    async def batch(self, ps: list[list[int]], gen: int, specs: list) -> float:
        """Seconds from sending the first of `ps` to holding every response and its results."""
        c0 = self._cpu()
        t, g = time.perf_counter(), GC.total
        gens = await asyncio.gather(*(self.client.generate(p, s, max_tokens=gen, temperature=0.0, ignore_eos=True)
                                      for p, s in zip(ps, specs)))
        took = time.perf_counter() - t
        # Results read from files are released in the background (`AsyncClient._release_soon`):
        # done before the CPU times are read, so that they count it
        await self.client.release_pending()
        self.gc_s = GC.total - g
        self.cpu_s = tuple(b - a for a, b in zip(c0, self._cpu()))
        self.delivered = 0
        for g, s in zip(gens, specs):      # a failed op is an error in the results: none here
            if s is not None and (g.results is None or not g.results.ok):
                raise RuntimeError(f"request failed: {g.results and g.results.errors}")
            if g.results is not None:
                self.delivered += sum(x.numel() * x.element_size() for per_layer in g.results.activations.values()
                                      for x in per_layer.values())
        return took


async def counters(driver: Driver) -> dict:
    """The plugin server's counters (`GET /v1/hook/health`): its frontend's and rank 0's."""
    h = (await driver.http.get("/v1/hook/health")).json()
    w = (h.get("workers") or [{}])[0]
    out = {f"worker.{k}": v for k, v in (w.get("timing") or {}).items()}
    out.update({f"frontend.{k}": v for k, v in (h.get("frontend") or {}).items()})
    return out


class Sampler:
    """`--profile-api`: py-spy sampling a server's API process (native frames and thread ids
    included) while one batch runs, its collapsed stacks to a file, and each thread's CPU
    seconds meanwhile (py-spy sees Python threads only, not torch's) to `*.threads.json`.
    py-spy pauses the process for each sample: such batches run after a case's measured reps
    and are left out of its figures (`profiled`)."""

    def __init__(self, exe: str, pid: int, out: Path):
        import subprocess

        self.pid, self.out, self.cpu0 = pid, out, thread_cpu(pid)
        with open(f"{out}.log", "w") as log:
            self.proc = subprocess.Popen([exe, "record", "--native", "--threads", "--rate", "100",
                                          "--format", "raw", "--output", str(out), "--pid", str(pid)],
                                         stdout=subprocess.DEVNULL, stderr=log)
        # (blocking: the client runs nothing else now) attached before the batch starts
        time.sleep(1.0)
        if self.proc.poll() is not None:
            print(f"[profile] py-spy exited at once (rc {self.proc.returncode}): see {out}.log", flush=True)

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)      # py-spy writes its file on SIGINT
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        cpu = thread_cpu(self.pid)
        got = sorted(((round(c - self.cpu0.get(t, (name, 0.0))[1], 3), t, name) for t, (name, c) in cpu.items()),
                     reverse=True)
        Path(f"{self.out}.threads.json").write_text(json.dumps([g for g in got if g[0] > 0]))


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Thread id -> (name, CPU seconds so far) of process `pid`'s threads (Linux's /proc);
    empty once it has ended."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:           # ended meanwhile
            continue
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


PROFILE: dict = {}       # `--profile-api`: {"exe": py-spy, "dir": where, "reps": hooked batches to sample}


async def profiled(driver: "Driver", label: str, n: int, plen: int, gen: int, specs: list, vocab: int) -> list[float]:
    """`--profile-reps` hooked batches of a case, each sampled (`Sampler`), after its measured
    reps: their seconds, which are not figures."""
    if not PROFILE or driver.server is None:
        return []
    way = "files" if driver.client.local_results else "http"
    took = []
    for rep in range(PROFILE["reps"]):
        spy = Sampler(PROFILE["exe"], driver.server.pid, Path(PROFILE["dir"]) / f"api-{label}-{way}-{rep}.txt")
        try:
            took.append(await driver.batch(prompts(n, plen, vocab, seed=next(FRESH)), gen, specs))
        finally:
            spy.stop()
    return took


async def run_case(drivers, name, spec_of, n, plen, gen, reps, vocab) -> dict:
    specs = [spec_of(i) for i in range(n)]
    plain = [None] * n
    rows = []
    before = await counters(drivers["plugin"])
    second = ("native_b_s", "native_b") if "native_b" in drivers else ("native_2_s", "native")
    for rep in range(reps):
        first, then = [("hooked_s", specs), ("unhooked_s", plain)][::1 if rep % 2 == 0 else -1]
        # No server serves two batches in a row: on the H200 a server's batch right after its
        # own previous one took 1.4 to 1.8x as long, native's and the plugin's alike (run 80).
        row = {}
        for key, server, sp in (("native_s", "native", plain), (first[0], "plugin", first[1]),
                                (*second, plain), (then[0], "plugin", then[1])):
            g0 = await counters(drivers[server]) if server == "plugin" else None
            # Prompts no server has seen: a batch repeating another's would read the prefix
            # cache that one wrote (steering's salt keeps its own out; a capture's and an
            # unhooked batch's would not), and the rep's second batch on a server would gain.
            ps = prompts(n, plen, vocab, seed=next(FRESH))
            row[key] = await drivers[server].batch(ps, gen, sp)
            if g0 is not None:       # the plugin server's collector: its API process, rank 0's
                g1 = await counters(drivers[server])
                row[key.replace("_s", "_server_gc_s")] = [g1.get(k, 0) - g0.get(k, 0)
                                                          for k in ("frontend.gc_s", "worker.gc_s")]
            row[key.replace("_s", "_gc_s")] = drivers[server].gc_s
            row[key.replace("_s", "_cpu_s")] = drivers[server].cpu_s
            if key == "hooked_s":
                row["delivered_bytes"] = drivers[server].delivered
        if "native_2_s" in row:          # without --control native runs twice a rep: their mean
            row["native_s"] = (row["native_s"] + row.pop("native_2_s")) / 2
        rows.append(row)
    after = await counters(drivers["plugin"])
    res = {"workload": name, "n": n, "prompt_len": plen, "gen": gen, "reps": rows,
           "host_us_per_request": {label: 1e6 * (after.get(k, 0) - before.get(k, 0)) / (n * reps)
                                   for k, label in SERVED_STAGES.items()},
           # the hooked requests fetched while they decoded (`FetchBatcher.hold`), a share
           "fetched_while_decoding": (after.get("frontend.fetched_while_running", 0)
                                      - before.get("frontend.fetched_while_running", 0)) / (n * reps)}
    for est, num, den in (("in_engine", "hooked_s", "unhooked_s"), ("vs_native", "hooked_s", "native_s"),
                          ("unhooked_vs_native", "unhooked_s", "native_s"), ("native_b_vs_native", "native_b_s", "native_s")):
        if num in rows[0]:
            res[est] = median_ci([r[num] / r[den] for r in rows])
    res["client_gc_ms"] = [1e3 * median_ci([r[k] for r in rows])[0] for k in ("hooked_gc_s", "unhooked_gc_s")]
    # The plugin server's collector a batch, ms (hooked, unhooked): its API process, rank 0's
    res["server_gc_ms"] = {proc: [1e3 * median_ci([r[k][i] for r in rows])[0] for k in ("hooked_server_gc_s", "unhooked_server_gc_s")]
                           for i, proc in enumerate(("api_server", "engine"))}
    # CPU time the hooked batch took more than the unhooked one on the plugin server, per request:
    # robust where wall-clock ratios are noise (the work is counted whenever it ran)
    res["cpu_us_per_request"] = {
        proc: median_ci([1e6 * (r["hooked_cpu_s"][i] - r["unhooked_cpu_s"][i]) / n for r in rows])
        for i, proc in enumerate(("api_server", "engine", "client"))}
    res["requests_per_s_native"] = n / min(r["native_s"] for r in rows)
    # The bandwidth at which moving the results' bytes alone would take the hooked batch's extra time.
    res["delivered_mb"] = rows[0]["delivered_bytes"] / 1e6
    extra = sorted(r["hooked_s"] - r["unhooked_s"] for r in rows)[len(rows) // 2]
    res["delivered_gb_per_extra_s"] = res["delivered_mb"] / 1e3 / extra if extra > 0 and res["delivered_mb"] else None
    print(f"  {name:30s} n={n:<4d} {plen}+{gen}: in-engine {res['in_engine'][0]:.3f} "
          f"[{res['in_engine'][1]:.3f}, {res['in_engine'][2]:.3f}]  vs native {res['vs_native'][0]:.3f}  "
          f"native {1e3 * min(r['native_s'] for r in rows):.0f} ms", flush=True)
    try:         # (after the figures: a profiling failure costs the profile alone)
        sampled = await profiled(drivers["plugin"], f"{name}-{n}x{plen}+{gen}", n, plen, gen, specs, vocab)
        if sampled:
            res["profiled_s"] = sampled
    except Exception as e:
        res["profile_error"] = repr(e)
        print(f"[profile] {name} n={n}: {e!r}", flush=True)
    return res


def _label(case: dict, meta: dict) -> str:
    """A case's workload, and how its large results came (runs before `--deliveries`: the meta's)."""
    d = case.get("delivery", "files" if meta.get("local_results", False) else "http")
    return case["workload"] + (" (over HTTP)" if d == "http" else "")


def report(result: dict) -> str:
    m = result["meta"]
    lines = [f"Run {m['started']}: vLLM {m.get('vllm')}, torch {m.get('torch')}, {m.get('gpu')}; model {m['shape']}; "
             f"wall {m.get('wall_s', 0):.0f} s; served (`vllm serve`, results inline up to "
             f"{m.get('inline_bytes') or 'the default 1 MiB'} bytes, larger by handle: read from their "
             "files, or fetched over HTTP where a row says so). Ratios: median "
             "[95 % bootstrap interval] over reps. " + host_line(m), "",
             "| workload | requests | prompt + generated | in-engine (hooked / unhooked) | vs native | "
             "unhooked vs native | second native vs native | native, requests/s | results delivered (MB) | "
             "MB / extra s | target | client's garbage collection, ms: hooked / unhooked |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("cases", []):
        ie, uv = r["in_engine"], r["unhooked_vs_native"]
        nb = r.get("native_b_vs_native")
        lines.append(f"| {_label(r, m)} | {r['n']} | {r['prompt_len']} + {r['gen']} | {ie[0]:.3f} [{ie[1]:.3f}, "
                     f"{ie[2]:.3f}] | {r['vs_native'][0]:.3f} | {uv[0]:.3f} [{uv[1]:.3f}, {uv[2]:.3f}] | "
                     + (f"{nb[0]:.3f} [{nb[1]:.3f}, {nb[2]:.3f}]" if nb else "–")
                     + f" | {r['requests_per_s_native']:.0f} | {r.get('delivered_mb', 0):.3g} | "
                     + (f"{1e3 * r['delivered_gb_per_extra_s']:.0f}" if r.get("delivered_gb_per_extra_s") else "–")
                     + f" | {verdict(r)} | "
                     + (f"{r['client_gc_ms'][0]:.1f} / {r['client_gc_ms'][1]:.1f} |" if "client_gc_ms" in r else "– |"))
    lines += ["", "CPU time per request, the hooked batch's over the unhooked one's on the plugin server (µs, "
              "median [95 % interval] over reps; from the processes' CPU clocks, whenever the work ran):", "",
              "| workload | requests | prompt + generated | API server | engine core and workers | client "
              "| collector a batch, ms, hooked / unhooked: API server; rank 0's process |",
              "|---|---|---|---|---|---|---|"]
    for r in result.get("cases", []):
        c = r.get("cpu_us_per_request")
        if c:
            lines.append(f"| {_label(r, m)} | {r['n']} | {r['prompt_len']} + {r['gen']} | "
                         + " | ".join(f"{c[k][0]:.0f} [{c[k][1]:.0f}, {c[k][2]:.0f}]"
                                      for k in ("api_server", "engine", "client")) + " | "
                         + ("; ".join(f"{g[0]:.1f} / {g[1]:.1f}" for g in r["server_gc_ms"].values())
                            if "server_gc_ms" in r else "–") + " |")
    lines += ["", "Plugin server's host time per hooked request by stage (µs, from its counters):", "",
              "| workload | requests | gen | " + " | ".join(SERVED_STAGES.values()) + " |",
              "|---|---|---|" + "---|" * len(SERVED_STAGES)]
    for r in result.get("cases", []):
        if "host_us_per_request" in r:
            lines.append(f"| {_label(r, m)} | {r['n']} | {r['gen']} | "
                         + " | ".join(f"{r['host_us_per_request'][s]:.0f}" for s in SERVED_STAGES.values()) + " |")
    return "\n".join(lines) + "\n"


async def bench(args, model: str, cfg: dict, result: Record) -> None:
    servers = start_servers(args, model, result.out)
    drivers = {}
    try:
        n_max = max(int(b.split("x")[0]) for b in args.batches)
        drivers = {name: Driver(s.url, n_max, args.client_limits, s.proc.pid)
                   for name, s in servers.items()}
        # the plugin server's clients, one per way its large results reach them
        plugin = {d: drivers["plugin"] if d == "files" else
                  Driver(servers["plugin"].url, n_max, args.client_limits, servers["plugin"].proc.pid,
                         local_results=False) for d in args.deliveries}
        drivers.update({f"plugin.{d}": v for d, v in plugin.items()})
        import torch

        await drivers["plugin"].client.register_vectors({VECTOR: torch.randn(cfg["hidden_size"])})
        if not args.no_gc_freeze:
            gc.collect()
            gc.freeze()
        wl = workloads(cfg["num_hidden_layers"])
        for k, b in enumerate(args.batches):
            n, rest = b.split("x")
            plen, gen = rest.split("+")
            for name in args.workloads:
                # the ways of delivery take turns at going first, batch size by batch size
                for d in args.deliveries if k % 2 == 0 else args.deliveries[::-1]:
                    case = await run_case({**drivers, "plugin": plugin[d]}, name, wl[name], int(n), int(plen),
                                          int(gen), args.reps, cfg["vocab_size"])
                    result["cases"].append({**case, "delivery": d})
                    result.save()
    finally:
        for d in {id(d): d for d in drivers.values()}.values():
            await d.http.aclose()
        for s in servers.values():
            s.stop()


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--batches", nargs="+", help="NxPROMPT+GEN (default 64x128+1 64x128+128 256x128+1 "
                    "256x128+128; with --smoke 8x16+1 8x16+4)")
    ap.add_argument("--workloads", nargs="+", default=["unused", "steer_add_all_layers",
                                                        "capture_last_prompt_4_layers", "mixed_thirds"])
    ap.add_argument("--reps", type=int, help="default 5 (2 with --smoke)")
    ap.add_argument("--gpu-mem", type=float, default=0.35)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--inline-bytes", type=int,
                    help="the plugin server's max_inline_result_bytes (larger results go by handle; "
                         "default: the plugin's, 1 MiB; runs 48 and 49 used 64 MiB: all inline)")
    ap.add_argument("--control", action="store_true",
                    help="start a second native server: the two natives' ratio is the machine's floor")
    ap.add_argument("--client-limits", choices=["none-kept", "async-client"], default="none-kept",
                    help="the client's connection pool: none kept alive (default), or vllm_hook.AsyncClient's "
                         "own limits (1,024 connections, 20 kept alive)")
    ap.add_argument("--deliveries", nargs="+", choices=["files", "http"], default=["files"],
                    help="how the client gets results kept by handle: read from their files (`local_results`, "
                         "the default), fetched over HTTP as by a client on another host, or each workload both "
                         "ways in turn")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the client's heap to Python's collector (default: frozen once set up)")
    ap.add_argument("--profile-api", metavar="PY_SPY",
                    help="sample the plugin server's API process with this py-spy during --profile-reps "
                         "extra hooked batches of each case, after its measured reps and left out of its "
                         "figures (collapsed stacks and each thread's CPU seconds in --out)")
    ap.add_argument("--profile-reps", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny batches")
    ap.add_argument("--smoke-layers", type=int, default=4, help="--smoke: layers of the tiny Qwen2")
    args = ap.parse_args()
    args.deliveries = list(dict.fromkeys(args.deliveries))
    if args.smoke:
        from vllm_hook.testing.tiny_models import tiny_model

        model = tiny_model("qwen2", layers=args.smoke_layers)
        args.batches = args.batches or ["8x16+1", "8x16+4"]
        args.reps = args.reps or 2
    else:
        from make_model import build

        model = args.model or build(args.shape, "/tmp/vh_models")
    args.batches = args.batches or ["64x128+1", "64x128+128", "256x128+1", "256x128+128"]
    args.reps = args.reps or 5
    cfg = json.loads((Path(model) / "config.json").read_text())
    result = Record(Path(args.out), run_meta(model, cfg, inline_bytes=args.inline_bytes,
                                              client_limits=args.client_limits, gc_freeze=not args.no_gc_freeze,
                                              deliveries=args.deliveries),
                    render=report, cases=[])
    if args.profile_api:
        PROFILE.update(exe=args.profile_api, dir=args.out, reps=args.profile_reps)
    try:
        asyncio.run(bench(args, model, cfg, result))
    finally:
        result.save()
    print(report(result))


if __name__ == "__main__":
    main()
