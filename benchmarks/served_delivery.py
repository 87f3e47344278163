"""A served client's cost to receive large results: by handle over HTTP against from their files.

    python benchmarks/served_delivery.py [--results 85] [--rounds 5] [--out FILE] [--src DIR]

The served mixed batch at 256 x 128 + 128 (run 154) returns 85 results of every prompt and
generated token at 4 layers (3.1 MB of bf16 each, 6.3 MB of float32 in the user's hands), all
kept by handle, and its client's CPU time was most of the batch's extra time. This times that
delivery alone on this host, with the plugin's own pieces: a server process (uvicorn) with the
plugin's routes (`server.routes`) and result store (`server.store`), the results encoded as
the API server encodes them (`server.encode.encode_one` on its encoding threads, the responses
asked for at once as a batch's requests finish; each result's layers back to back, as the
frontend holds them), and `vllm_hook.AsyncClient` turning a
response's entries into `Results` (`results_of`): with `local_results` (read from their files,
released in one call) and without (one GET each, `?delete=true`), alternating, medians of
`--rounds`. Reports the client's wall and CPU time per result (and, of its wall, the file
reads and the decoding: parsing, widening to float32), and the server process's CPU
time per result apart: making the response (encoding, and writing the files where asked) and
serving the client's fetches or release. No engine, no
model: the rows are random. A smoke test runs it in CI with small sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
from fastapi import Request  # module level: the route's annotation is resolved here

HERE = Path(__file__).resolve().parent


def _src() -> Path:
    """`--src DIR` (read before anything imports the plugin): the plugin's source to measure,
    another tree's `src/` for a before-and-after comparison; else this tree's."""
    src = HERE.parent / "src"
    for i, a in enumerate(sys.argv):
        if a == "--src" and i + 1 < len(sys.argv):
            src = Path(sys.argv[i + 1]).resolve()
        elif a.startswith("--src="):
            src = Path(a.split("=", 1)[1]).resolve()
    if not (src / "vllm_hook" / "__init__.py").is_file():
        raise SystemExit(f"--src {src}: no vllm_hook package there (name a tree's src/)")
    return src


sys.path[:0] = [str(HERE), str(_src()), str(HERE.parent / "scripts")]


def serve(port: int, rows: int, hidden: int) -> None:
    """The server process: the plugin's routes, and POST /bench/make?n=&local= that encodes
    n results into the store as the API server does and returns their entries."""
    import torch
    import uvicorn
    from fastapi import FastAPI

    from vllm_hook.adapters.server import SERVED_ATTR, Served, _encoder
    from vllm_hook.config import HookConfig
    from vllm_hook.results import Results
    from vllm_hook.server import encode
    from vllm_hook.server.routes import router
    from vllm_hook.server.store import ResultStore

    cfg = HookConfig(max_inline_result_bytes=0)         # every result by handle, whatever its size
    store = ResultStore(cfg.max_retained_bytes, cfg.result_ttl_s, local_dir=cfg.result_spill_dir)
    engine = type("Engine", (), {})()
    engine.__dict__[SERVED_ATTR] = Served(None, store)
    # Rows as the API server holds such results: each request's layers back to back in a
    # block of its own (the frontend joins a large result's prompt block and decode runs so),
    # KINDS requests' results in turn. (Layers apart, as small results packed across a fetch's
    # requests lie, stood in for them in runs 166 and 168.)
    layers, kinds = (4, 9, 16, 26), 16
    payload = torch.randn(kinds, len(layers), rows, hidden).to(torch.bfloat16)
    pos = torch.arange(rows)
    made = []
    for k in range(kinds):
        r = Results(request_id=f"cmpl-{k}", prompt_len=rows // 2, token_ids=list(range(rows + 1)), model="m")
        for i, layer in enumerate(layers):
            r.activations.setdefault("resid_post", {})[layer] = payload[k, i]
            r.positions.setdefault("resid_post", {})[layer] = pos
        r.widen_to = "float32"
        made.append(r)
    app = FastAPI()
    app.state.engine_client = engine
    app.include_router(router)
    turn = itertools.count()

    # (`threaded`: as on the API server's encoding threads; a tree before it has no such argument)
    threaded = {"threaded": True} if "threaded" in inspect.signature(encode.encode_one).parameters else {}

    def entries(n: int, local: bool) -> list[dict]:
        return [encode.encode_one(made[next(turn) % kinds], i, store, cfg, stacked=True, local=local, **threaded)
                for i in range(n)]

    @app.post("/bench/make")
    async def make(request: Request):
        q = request.query_params
        n, local = int(q["n"]), q["local"] == "1"
        # encoded where the API server encodes large results: on its encoding threads
        got = await asyncio.get_running_loop().run_in_executor(_encoder(), entries, n, local)
        return {"vllm_hook": {"results": got}}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def measure(url: str, n: int, rounds: int, pid: int, per_response: int | None = None) -> dict:
    import httpx

    from vllm_hook import AsyncClient
    from vllm_hook import client as client_mod

    # The client's two stages, timed where they run (wall ms summed over a round): reading a
    # result file (`_read_local`) and decoding a result (`_decode`: parsing and widening)
    spent = {"read": 0.0, "decode": 0.0}

    def timed(stage, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[stage] += time.perf_counter() - t0
        return run
    client_mod._read_local = timed("read", client_mod._read_local)
    client_mod._decode = timed("decode", client_mod._decode)

    out: dict = {}
    files: list[int] = []           # results offered as files, each round asking for them
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for _ in range(rounds + 1):                # the first round warms up, untimed
            for local in (True, False):
                k = per_response or n
                s0 = _cpu(pid)
                # (concurrent requests, as a served batch's: their encoding side by side)
                rs = await asyncio.gather(*(http.post(f"/bench/make?n={min(k, n - at)}&local={int(local)}")
                                            for at in range(0, n, k)))
                s1 = _cpu(pid)
                assert all(r.status_code == 200 for r in rs), next(r.text[:2000] for r in rs if r.status_code != 200)
                resps = [r.json() for r in rs]
                entries = [e for resp in resps for e in resp["vllm_hook"]["results"]]
                # (a /dev/shm too small for a quarter of the batch keeps some in memory)
                assert all(e["handle"] for e in entries) and (local or not any(e.get("local") for e in entries))
                if local:
                    files.append(sum(bool(e.get("local")) for e in entries))
                client = AsyncClient(url, http=http, local_results=local)
                spent.update(read=0.0, decode=0.0)
                t, c = time.perf_counter(), time.process_time()
                # (responses of `per_response` results: each response's results at once, as
                # concurrent requests' responses arrive)
                got = [g for gs in await asyncio.gather(*(client.results_of(resp) for resp in resps)) for g in gs]
                wall = time.perf_counter() - t         # the results in hand
                await client.release_pending()         # (the release, in the background: its CPU counted)
                cpu = time.process_time() - c
                server = (s1 - s0, _cpu(pid) - s1)
                assert len(got) == n and all(g.ok and g.activations["resid_post"][4].dtype.is_floating_point
                                             for g in got)
                out.setdefault(local, []).append((wall, cpu, *server, spent["read"], spent["decode"]))
                del got
    res = {}
    for local, runs in out.items():
        runs = runs[1:]
        key = "from_files" if local else "over_http"
        res[key] = {k: round(1e3 * statistics.median(x[i] for x in runs) / n, 3) for i, k in enumerate((
            "wall_ms_per_result", "client_cpu_ms_per_result", "server_cpu_ms_per_result_making",
            "server_cpu_ms_per_result_delivering", "client_read_ms_per_result", "client_decode_ms_per_result"))}
    res["from_files"]["offered_as_files"] = min(files)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--results", type=int, default=85)
    ap.add_argument("--rows", type=int, default=256, help="rows per layer (prompt + generated)")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-response", type=int, help="results per response (default: all in one), the "
                    "responses' results read at once: 1 is a served batch's (one result per request)")
    ap.add_argument("--out")
    ap.add_argument("--src", help="the plugin's src/ to measure (default: this tree's); the server process uses it too")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.rows, args.hidden)
        return
    from gpu_serve_check import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--rows", str(args.rows),
                             "--hidden", str(args.hidden), "--src", str(_src())])
    try:
        url = f"http://127.0.0.1:{port}"
        import httpx

        for _ in range(300):
            try:
                httpx.get(f"{url}/docs", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"the benchmark's server did not answer at {url} within 30 s")
        from run import host_probe

        import vllm_hook

        res = {"src": str(Path(vllm_hook.__file__).parent.parent), "results": args.results, "per_response": args.per_response or args.results, "rows": args.rows, "hidden": args.hidden,
               "mb_per_result_bf16": round(4 * args.rows * args.hidden * 2 / 1e6, 2), "rounds": args.rounds,
               **asyncio.run(measure(url, args.results, args.rounds, proc.pid, args.per_response)), "host": host_probe(), "cpus": os.cpu_count()}
    finally:
        # SIGINT: uvicorn stops, and the process exits as a server does (its result store's
        # files removed); after SIGTERM uvicorn re-raises it, and the process dies at once
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
