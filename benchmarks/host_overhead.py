"""Host-side cost per decode step of the plugin's routing and capture delivery, on the CPU.

    python benchmarks/host_overhead.py [--out FILE]

On the GPU, vLLM's step is partly host-bound (async scheduling overlaps the next step's host
work with the current forward), so Python work per step can show up in decode time. This
times, without an engine, what the worker does per step for the benchmark workloads: the
routing (`routing.route_step`) and the hand-over of captured rows to the request stores
(`Collector._hand_over` + `RequestStore.add`), for 1 to 16 decoding requests on a 28-layer
model. It prints microseconds per step. Then it drives the worker runtime itself
(`HookRuntime.begin_step` + `end_step`, fake batch views, 16 decoding requests) for steering,
capture and the mixed batch, routing every step in full against repeating the last step's
routing (`worker.repeat`, what steady decode does). Then it times the host side of fetching one request's
capture of every layer and token of a 512-token prompt (42 MiB in bf16): the worker's
hand-over, then by the RPC (wire bytes, a pickle round trip standing in for the RPC, the
frontend's `Results`) and through a shared-memory file (`result_spill_dir`).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vllm_hook.delivery.collector import Collector  # noqa: E402
from vllm_hook.delivery.spill import open_entry, spill_target  # noqa: E402
from vllm_hook.delivery.hostmem import host_empty  # noqa: E402
from vllm_hook.delivery.store import RequestStore  # noqa: E402
from vllm_hook.model.layout import PointTable  # noqa: E402
from vllm_hook.results import build  # noqa: E402
from vllm_hook.adapters.base import NewRequest, SchedulerEvents, StepView  # noqa: E402
from vllm_hook.config import HookConfig  # noqa: E402
from vllm_hook.model.buffers import BufferShape, HookBuffers  # noqa: E402
from vllm_hook.routing import CaptureRoute, RequestRoutes, Rows, SteerRoute, route_step  # noqa: E402
from vllm_hook.spec import HookSpec, ModelInfo, resolve  # noqa: E402
from vllm_hook.worker.runtime import HookRuntime  # noqa: E402

L, K, H = 28, 2, 1536


class _Req:
    def __init__(self):
        self.store = RequestStore()


def workload(kind: str, n: int):
    out = []
    for i in range(n):
        if kind == "steer_add_all_layers":
            r = RequestRoutes(128, steer=tuple(SteerRoute(col=layer * K, entry=1 + i * L + layer, sel="all")
                                               for layer in range(L)))
        elif kind == "capture_all_tokens_all_layers":
            r = RequestRoutes(128, capture=tuple(CaptureRoute(point=layer, sels=(("all", ()),))
                                                 for layer in range(L)))
        else:   # capture_all_tokens_4_layers
            r = RequestRoutes(128, capture=tuple(CaptureRoute(point=layer, sels=(("all", ()),))
                                                 for layer in (4, 9, 16, 26)))
        out.append((_Req(), r, Rows(i, 1, 130)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    pool = torch.zeros(65536, H, dtype=torch.bfloat16)
    res = []
    for kind in ("steer_add_all_layers", "capture_all_tokens_4_layers", "capture_all_tokens_all_layers"):
        for n in (1, 4, 8, 16):
            entries = workload(kind, n)
            op, cap = np.zeros((64, L * K), np.int64), np.zeros((64, 2 * L), np.int64)
            col = Collector([pool, None, None], lambda seg, rows: seg.owner.store.add(
                seg.points, seg.positions, rows, seg.last_only))
            t_route = t_deliver = 0.0
            for _ in range(args.steps):
                t = time.perf_counter()
                routing = route_step(entries, op, cap, 65536)
                t_route += time.perf_counter() - t
                t = time.perf_counter()
                col.after_forward(routing)
                t_deliver += time.perf_counter() - t
            row = {"workload": kind, "requests": n, "route_us": 1e6 * t_route / args.steps,
                   "deliver_us": 1e6 * t_deliver / args.steps}
            res.append(row)
            print(f"{kind:32s} {n:3d} requests: route {row['route_us']:7.0f} us/step, "
                  f"deliver {row['deliver_us']:7.0f} us/step", flush=True)
    steps = runtime_steps(args.steps)
    fetch = fetch_stages()
    print("fetch of a 512-token all-layer capture, ms (min of 3): "
          + ", ".join(f"{k} {v:.1f}" for k, v in fetch.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"per_step": res, "runtime_step": steps, "fetch_ms": fetch}, indent=1))


def runtime_steps(steps: int, n: int = 16, P: int = 128) -> list[dict]:
    """The worker runtime's host time per decode step (begin_step + end_step) for `n` decoding
    requests, routed in full every step and repeated (steady decode), µs."""
    info = ModelInfo(num_layers=L, hidden_size=H)
    cfg = HookConfig()
    points = PointTable.for_config(L, cfg)
    shape = BufferShape.for_engine(num_layers=L, hidden=H, max_num_batched_tokens=2048,
                                   max_num_seqs=256, cfg=cfg, points=points)
    vec = np.random.default_rng(0).standard_normal(H).astype(np.float32).tolist()
    steer1 = {"steer": [{"op": "add", "layer": L // 2, "vector": vec, "scale": 0.5}]}
    cap4 = {"capture": [{"layers": [4, 9, 16, 26], "tokens": "all"}]}
    kinds = {"steer_add_1_layer": lambda i: steer1,
             "steer_add_all_layers": lambda i: {"steer": [{"op": "add", "layer": x, "vector": vec, "scale": 0.05}
                                                          for x in range(L)]},
             "capture_all_tokens_4_layers": lambda i: cap4,
             "mixed_thirds": lambda i: [steer1, cap4, None][i % 3]}
    out = []
    for kind, spec_of in kinds.items():
        row = {"workload": kind, "requests": n}
        for mode in ("full", "repeated"):
            rt = HookRuntime(HookBuffers(shape, torch.bfloat16, torch.device("cpu")), points, cfg)
            new = []
            for i in range(n):
                spec = spec_of(i)
                wire = resolve(HookSpec(**spec), info, cfg, P, lambda name: None).wire if spec else None
                new.append(NewRequest(f"r{i}", wire, P))
            rt.on_events(SchedulerEvents(new=tuple(new)))
            index = {f"r{i}": i for i in range(n)}
            t_total = 0.0
            for k in range(steps):
                view = StepView(index=index, query_start_loc=np.arange(n + 1), num_computed=np.full(n, P + k),
                                num_tokens=n, num_tokens_padded=n)
                if mode == "full":
                    rt.repeat.forget()
                t = time.perf_counter()
                rt.begin_step(view)
                rt.end_step()
                t_total += time.perf_counter() - t
            row[f"{mode}_us"] = 1e6 * t_total / steps
        out.append(row)
        print(f"runtime step, {kind:28s} {n} requests: full {row['full_us']:6.0f} us, "
              f"repeated {row['repeated_us']:6.0f} us", flush=True)
    return out


def fetch_stages(P: int = 512, reps: int = 3, spill_dir: str = "/dev/shm") -> dict[str, float]:
    """Host stages of fetching one request's 512-token all-layer capture (42 MiB in bf16), by
    the RPC (bytes, pickled as the RPC would) and through a shared-memory file; minimum over
    `reps` (the shared-memory path reaches its steady state, reused files, from the second)."""
    pool = torch.randn((L + 1) * P, H).to(torch.bfloat16)
    points = tuple(range(L + 1))            # resid_post of every layer + resid_pre
    table = PointTable(L, ("resid_post", "resid_pre"))
    items = [{"site": "resid_post", "layer": i, "sel": "all", "pos": []} for i in range(L)]
    items.append({"site": "resid_pre", "layer": 0, "sel": "all", "pos": []})
    target = spill_target(spill_dir)
    best: dict[str, float] = {}

    def timed(stages, name, fn):
        t = time.perf_counter()
        out = fn()
        stages[name] = time.perf_counter() - t
        return out

    def results(wire, dtype="float32"):         # a spilled file is read and handed back for reuse
        build([open_entry(wire)], items, table, request_id="r", prompt_token_ids=list(range(P)),
              output_token_ids=[1], dtype=dtype)

    for _ in range(reps):
        stages: dict[str, float] = {}
        store = timed(stages, "hand-over", lambda: RequestStore())
        rows = host_empty(pool.shape, pool.dtype)
        timed(stages, "hand-over", lambda: store.add(points, np.arange(P), rows.copy_(pool), False))
        wire = timed(stages, "rpc: worker bytes", lambda: store.to_wire({"rank": 0}, None))
        wire = timed(stages, "rpc: pickle round trip", lambda: pickle.loads(pickle.dumps(wire)))
        timed(stages, "rpc: frontend Results", lambda: results(wire))
        # The shared-memory path reuses files: the first fetch writes new pages, later ones not.
        wire = timed(stages, "shm: worker file", lambda: store.to_wire({"rank": 0}, target))
        assert "path" in wire, "spill directory not writable"
        timed(stages, "shm: frontend Results", lambda: results(wire))
        wire = store.to_wire({"rank": 0}, target)
        timed(stages, "shm: frontend Results, dtype model", lambda: results(wire, "model"))
        for k, v in stages.items():
            best[k] = min(best.get(k, float("inf")), 1e3 * v)
    best["rpc total"] = sum(v for k, v in best.items() if k.startswith(("hand", "rpc:")))
    best["shm total"] = sum(v for k, v in best.items() if k.startswith(("hand", "shm:")) and "model" not in k)
    best["shm total, dtype model"] = (best["shm total"] - best["shm: frontend Results"]
                                      + best["shm: frontend Results, dtype model"])
    return best


if __name__ == "__main__":
    main()
