"""The plugin's host cost per request at admission and delivery, on the CPU (issue 17).

    python benchmarks/host_cost.py [--requests 256] [--rounds 5] [--out FILE]

No engine: the frontend's admission (parse and resolve, the resolution cache on and off), the
worker's admission and finish (`HookRuntime.on_events`) and the delivery of a small capture
(the worker's fetch into safetensors; the frontend's delivery as `attach` runs it, its read and
`Results` build apart), `--rounds` batches through one worker (medians reported), for a batch of
`--requests` requests on a 28-layer, 1536-wide model, each with max_tokens `--decode-steps` + 1
as an engine's (with 0, a capture ends at its prefill step and, from the second round on, the
worker makes its fetch reply there: counted in the prefill routing, no longer in the fetch);
with `--served`, also what a served response adds: the client's request body for the spec, the
server's encoding of each request's results (`server.encode`) and the client's decoding
(`Results.from_bytes`; a steering-only result from its choice's tokens), for results built in
float32 (as offline) and in the model's dtype, widened where loaded (as served: rows the worker
lent as several parts left as those, `wire`, beside joined in the parse as before,
`wire_joined`; each also written to a result file, `*_file`, as for a client on the server's
host). Prints
microseconds per request. A smoke test runs it in CI; the figures of record are the GPU's
(benchmarks/throughput.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vllm_hook.adapters.base import NewRequest, SchedulerEvents, StepView  # noqa: E402
from vllm_hook.client import _body, _decode, _inline, _json_bytes  # noqa: E402
from vllm_hook.config import HookConfig  # noqa: E402
from vllm_hook.delivery.arena import FRONTEND as ARENAS  # noqa: E402
from vllm_hook.delivery.spill import open_entry, spill_target, write_spilled  # noqa: E402
from vllm_hook.frontend.admission import Sealed, _admit  # noqa: E402
from vllm_hook.frontend.cache import one_call  # noqa: E402
from vllm_hook.frontend.delivery import Opened, _attach_all, merge_ranks, no_gc, nothing_to_fetch  # noqa: E402
from vllm_hook.frontend.state import STATE_ATTR, FrontendState  # noqa: E402
from vllm_hook.model.buffers import BufferShape, HookBuffers  # noqa: E402
from vllm_hook.model.layout import PointTable  # noqa: E402
from vllm_hook.results import ATTR, build  # noqa: E402
from vllm_hook.server import encode  # noqa: E402
from vllm_hook.server.store import ResultStore  # noqa: E402
from vllm_hook.spec import ModelInfo  # noqa: E402
from vllm_hook.worker.runtime import HookRuntime  # noqa: E402

L, H, P = 28, 1536, 128
MAX_TOKENS = 16384           # vLLM 0.26's max_num_batched_tokens on the H200
SPECS = {
    "steer_add_all_layers": {"steer": [{"op": "add", "layer": x, "vector": "bench_a", "scale": 0.05} for x in range(L)]},
    "capture_last_prompt_4_layers": {"capture": [{"layers": [4, 9, 16, 26], "tokens": "last_prompt"}]},
    # The mixed batch's heavy third (benchmarks/throughput.py `mixed_thirds`): every prompt and
    # generated token at 4 layers.
    "capture_all_tokens_4_layers": {"capture": [{"layers": [4, 9, 16, 26], "tokens": "all"}]},
}
# The same 28 ops with a scale of each request's own (steering per user): every request's
# spec is new to the frontend's cache and to the workers' shared steering. And a strength
# sweep: 8 scales over the batch (each scale's later requests repeat its spec).
SPECS["steer_add_all_layers_own_scale"] = SPECS["steer_add_all_layers"]
SPECS["steer_add_all_layers_8_scales"] = SPECS["steer_add_all_layers"]
OWN_SCALE = {"steer_add_all_layers_own_scale": lambda i: 1 + i / 1024,
             "steer_add_all_layers_8_scales": lambda i: 1 + (i % 8) / 8}


def _own_scale(spec: dict, factor: float) -> dict:
    return {"steer": [{**op, "scale": op["scale"] * factor} for op in spec["steer"]]}


def frontend(cfg: HookConfig) -> SimpleNamespace:
    info = ModelInfo(num_layers=L, hidden_size=H, num_heads=12, num_kv_heads=2, head_dim=128, dtype="bfloat16")
    st = FrontendState(cfg=cfg, info=info, points=PointTable.for_config(L, cfg), max_model_len=4096)
    st.names["bench_a"] = ("d" * 32, 39.2)
    ip = SimpleNamespace()
    ip.__dict__[STATE_ATTR] = st
    return ip


def admit_batch(ip, spec: dict, n: int, cache: bool, one_object: bool = False,
                varied: bool = False, own_scale=None, max_tokens: int = 2) -> tuple[float, list]:
    """Seconds per request of the frontend's admission of `n` requests of `spec`: each its own
    copy of it (served: one parsed body per HTTP request), or with `one_object` the one
    object offline `LLM.generate` passes through for every prompt (`admission.Sealed`) in
    one call (`cache.one_call`). `varied`: prompts of 128 lengths around P, as a dataset's.
    `own_scale`: request i's steering scale times `own_scale(i)` (`OWN_SCALE`)."""
    st = ip.__dict__[STATE_ATTR]
    st.resolved.clear()
    shared = Sealed(json.loads(json.dumps(spec)))
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(
        extra_args={"vllm_hook": shared if one_object else
                    json.loads(json.dumps(_own_scale(spec, own_scale(i)) if own_scale else spec))},
        skip_reading_prefix_cache=False, max_tokens=max_tokens), prompt_token_ids=list(range(P - 64 + i % 128 if varied else P)),
        cache_salt=None) for i in range(n)]
    with one_call():
        t = time.perf_counter()
        for i, r in enumerate(reqs):
            if not cache:
                st.resolved.clear()
            _admit(ip, str(i), r)
        return (time.perf_counter() - t) / n, reqs


def worker(cfg: HookConfig) -> HookRuntime:
    points = PointTable.for_config(L, cfg)
    shape = BufferShape.for_engine(num_layers=L, hidden=H, max_num_batched_tokens=MAX_TOKENS, max_num_seqs=256,
                                   cfg=cfg, points=points)
    rt = HookRuntime(HookBuffers(shape, torch.bfloat16, torch.device("cpu")), points, cfg)
    rt.register_vectors({"bench_a": np.random.default_rng(0).standard_normal(H).astype(np.float32).tobytes()})
    return rt


def step(rt: HookRuntime, ids: list[str], rows_each: int, computed: list[int]) -> float:
    """Seconds of the worker's routing and copy queueing for one step of `ids`."""
    k = len(ids)
    view = StepView(index={r: i for i, r in enumerate(ids)},
                    query_start_loc=np.arange(k + 1, dtype=np.int32) * rows_each,
                    num_computed=np.array(computed, dtype=np.int32), num_tokens=k * rows_each,
                    num_tokens_padded=k * rows_each)
    t = time.perf_counter()
    rt.begin_step(view)
    rt.end_step()
    return time.perf_counter() - t


def served_cost(opened, fetched, keys, items, points, gen, cfg, files: str, wires=("wire", "wire_joined")) -> dict:
    """µs per request of a served response's results: the server's parse and build, its
    encoding and the client's decoding, for results built in float32 and in the model's dtype
    (widened by the client); in the model's dtype also as served now (`wire`: rows the worker
    lent as several parts left as those, `parse_batch(join=False)`) beside joined in the parse
    (`wire_joined`, as before), and each encoded into a file in `files` too (`*_file`: the
    encoding of a result for a client on the server's host)."""
    out, store = {}, ResultStore(1 << 40, 600.0)
    kept = ResultStore(1 << 40, 600.0, local_dir=files)
    to_files = HookConfig(max_inline_result_bytes=cfg.max_inline_result_bytes, local_results=True)
    ways = {"wire": ("model", "float32", False), "wire_joined": ("model", "float32", True)}
    for label, dtype, widen, join in (("float32", "float32", None, True), *((w, *ways[w]) for w in wires)):
        built, t = [], time.perf_counter()
        for k in keys:
            r = build([opened.part(e, dtype, join=join) for e in fetched.get(k, [])], items, points, request_id="r",
                      prompt_token_ids=list(range(P)), output_token_ids=gen, dtype=dtype)
            r.widen_to = widen
            built.append(r)
        t_build = time.perf_counter() - t
        t = time.perf_counter()
        # The response shows each choice's token ids (`return_token_ids`), and the client reads
        # "tokens" entries, as the plugin's clients do.
        shown = {0: (list(range(P)), gen)}
        # (off the event loop, as the server encodes a response of ON_LOOP_BELOW bytes or more)
        entries = [encode.encode_one(r, 0, store, cfg, shown, threaded=encode.result_nbytes(r) >= encode.ON_LOOP_BELOW)
                   for r in built]
        t_enc = time.perf_counter() - t
        t = time.perf_counter()          # the client's: inline base64 decoded, or by handle
        for e in entries:
            _decode(e, _inline(e) or (store.pop(e["handle"]) if e["handle"] else None), shown)
        t_dec = time.perf_counter() - t
        out.update({f"served_read_build_{label}_us": 1e6 * t_build / len(keys),
                    f"served_encode_{label}_us": 1e6 * t_enc / len(keys),
                    f"client_decode_{label}_us": 1e6 * t_dec / len(keys),
                    f"served_bytes_{label}": sum(e["bytes"] for e in entries) / len(keys)})
        if label != "float32":
            # stacked sites, as the plugin's clients read them; a large result into its file
            # (twice, the second timed: into the files the first released, as a server's
            # steady state reuses them)
            for _ in range(2):
                t = time.perf_counter()
                handles = [encode.encode_one(r, 0, kept, to_files, shown, stacked=True, local=True)["handle"]
                           for r in built]
                out[f"served_encode_{label}_file_us"] = 1e6 * (time.perf_counter() - t) / len(keys)
                for h in handles:
                    if h:
                        kept.delete(h)      # released: its file kept for reuse
    return out


def client_spec_us(spec: dict, n: int) -> float:
    """µs a request the client's request body costs more with `spec` than without (the JSON it
    sends), each request with a spec dict of its own (as served benchmarks make them)."""
    sampling, prompt = {"max_tokens": 128, "temperature": 0.0}, list(range(P))
    own = [json.loads(json.dumps(spec)) for _ in range(n)]

    def per_request(specs) -> float:
        t = time.perf_counter()
        for s in specs:
            _json_bytes(_body({"model": "m", "prompt": prompt}, s, sampling))
        return (time.perf_counter() - t) / n

    return 1e6 * (per_request(own) - per_request([None] * n))


def one_round(ip, rt: HookRuntime, cfg: HookConfig, spill: dict, name: str, n: int, args, rnd: int) -> dict:
    """One batch of `n` requests of spec `name` through admission, routing, finish and
    delivery; µs per request by stage."""
    spec, own = SPECS[name], OWN_SCALE.get(name)
    # max_tokens: the last token is sampled, never forwarded
    admit = functools.partial(admit_batch, ip, spec, n, own_scale=own, max_tokens=args.decode_steps + 1)
    cold, _ = admit(cache=False)
    # (one object for every prompt cannot give each its own scale)
    offline, _ = admit(cache=True, one_object=not own)
    varied, _ = admit(cache=True, varied=True)
    warm, reqs = admit(cache=True)
    new = tuple(NewRequest(f"{i}-r{rnd:07d}", r.sampling_params.extra_args["vllm_hook"], P) for i, r in enumerate(reqs))
    t = time.perf_counter()
    rt.on_events(SchedulerEvents(new=new))
    t_admit = (time.perf_counter() - t) / n
    # Routing: the prefill steps (MAX_TOKENS // P requests each), then one decode step.
    ids = [nr.req_id for nr in new]
    t_route = 0.0
    for a in range(0, n, MAX_TOKENS // P):
        t_route += step(rt, ids[a:a + MAX_TOKENS // P], P, [0] * len(ids[a:a + MAX_TOKENS // P]))
    t_decode = sum(step(rt, ids, 1, [P + g] * n) for g in range(args.decode_steps)) / n
    t_route /= n
    # The prefill steps' copies (on the CPU the pools are host memory) went to the stores.
    stored = sum(req.store.nbytes for req in rt.requests.values())
    t = time.perf_counter()
    rt.on_events(SchedulerEvents(finished=frozenset(rt.requests)))
    t_finish = (time.perf_counter() - t) / n
    keys = [r.sampling_params.extra_args["vllm_hook"]["key"] for r in reqs]
    if stored:
        # An engine in its steady state has a handed-back file to write into (the first
        # fetch of a process writes a fresh one): make one as large as this payload.
        open_entry({"path": write_spilled({"x": torch.empty(stored + (1 << 20), dtype=torch.uint8)}, {},
                                          spill["dir"])})
    # The frontend has mapped the worker's arena (an engine's first fetch offers it and
    # names it: where clean marks are read).
    arenas = ()
    st = ip.__dict__[STATE_ATTR]
    if rt.collector is not None and rt.collector.arena is not None:
        ARENAS.adopt(rt.collector.arena.offer())
        arenas = ARENAS.tokens()
        st.arena_tokens = (rt.collector.arena.token.hex(),)
    items = st.pending["0"][1].items          # request 0 of the batch, as admitted
    gen = list(range(1, args.decode_steps + 2))       # max_tokens: the last one sampled, not forwarded
    outputs = [SimpleNamespace(request_id=str(i), prompt_token_ids=list(range(P)), finished=True,
                               outputs=[SimpleNamespace(index=0, token_ids=list(gen))]) for i in range(n)]
    todo = [(o, st.pop_pending(o.request_id)) for o in outputs]
    # As `attach`: requests their worker marked clean (steering only, once a fetch has named
    # the worker's arena: from the second round on) are not fetched; the others in one RPC.
    t = time.perf_counter()
    fetch_keys = [r.key for _, r in todo if not nothing_to_fetch(st, r)]
    fetched = merge_ranks([rt.fetch(fetch_keys, spill, arenas)], st) if fetch_keys else {}
    t_fetch = (time.perf_counter() - t) / n
    # The frontend's delivery as `attach` runs it once the RPC is back: each output's
    # parts read and its Results built and attached (read and build split by its counters).
    st.timing["read_s"] = st.timing["build_s"] = 0.0
    with no_gc():                          # as the frontend's delivery does
        t, opened = time.perf_counter(), Opened()
        _attach_all(st, todo, fetched, {}, opened)
        t_attach = (time.perf_counter() - t) / n
        t_read, t_build = st.timing["read_s"] / n, st.timing["build_s"] / n
        bad = [o.request_id for o in outputs if getattr(o, ATTR).errors]
        if bad:
            raise SystemExit(f"{name}: requests {bad[:4]} got errors: {getattr(outputs[0], ATTR).errors}")
        served = served_cost(opened, fetched, keys, items if stored else [], st.points, gen, cfg,
                             spill["dir"], args.served_ways) if args.served else {}
    if args.served:
        served["client_spec_us"] = client_spec_us(spec, n)
    return {"decode_steps": args.decode_steps, "frontend_admit_us": 1e6 * cold, "frontend_admit_cached_us": 1e6 * warm,
            "frontend_admit_offline_us": 1e6 * offline, "frontend_admit_varied_lengths_us": 1e6 * varied,
            "worker_admit_us": 1e6 * t_admit, "worker_prefill_routing_us": 1e6 * t_route,
            "worker_decode_routing_us": 1e6 * t_decode, "worker_finish_us": 1e6 * t_finish,
            "worker_fetch_us": 1e6 * t_fetch, "fetched_pct": 100 * len(fetch_keys) / n, "frontend_read_us": 1e6 * t_read,
            "frontend_build_us": 1e6 * t_build, "frontend_attach_us": 1e6 * t_attach, **served}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=1, help="decode steps of the whole batch after the prefill")
    ap.add_argument("--specs", nargs="+", default=list(SPECS), choices=list(SPECS))
    ap.add_argument("--arena-bytes", type=int, help="the workers' result arena (default: the plugin's; 0: none)")
    ap.add_argument("--served", action="store_true",
                    help="also time the served encoding and the client's decoding (float32 and model-dtype builds)")
    ap.add_argument("--served-ways", nargs="+", default=["wire", "wire_joined"], choices=["wire", "wire_joined"],
                    help="--served: the model-dtype ways timed, in this order (one a process: neither "
                         "warms the other's host memory)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="batches per spec through the same worker, as an engine runs them; the median is reported")
    ap.add_argument("--out")
    args = ap.parse_args()
    n = args.requests
    cfg = HookConfig(capture_pool_rows=65536, result_arena_bytes=args.arena_bytes)
    # Results travel as the engines send them: one file in shared memory per fetch.
    shm = tempfile.mkdtemp(prefix="vh_host_cost_", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    spill = spill_target(shm)
    ip = frontend(cfg)
    out = {}
    for name in args.specs:
        rt = worker(cfg)              # one worker for every round, as in an engine
        rounds = [one_round(ip, rt, cfg, spill, name, n, args, k) for k in range(args.rounds)]
        # the median of each stage over the rounds (one round: its figures)
        out[name] = {k: float(np.median([x[k] for x in rounds])) for k in rounds[0]}
        out[name]["rounds"] = args.rounds
        print(f"{name:30s} {n} requests, µs per request: " + ", ".join(f"{k} {v:.0f}" for k, v in out[name].items()
                                                                     if k not in ("decode_steps", "rounds")),
              flush=True)
    shutil.rmtree(shm, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
