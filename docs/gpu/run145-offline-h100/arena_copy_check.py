"""Ad-hoc: is a D2H copy into the arena asynchronous on this host? (not kept)"""
import sys, time, statistics
sys.path.insert(0, "src")
import torch
from vllm_hook.delivery.arena import make_arena
dev = torch.device("cuda")
arena = make_arena(2 << 30, dev)
print("arena", arena is not None)
src = torch.randn(4, 2730, 1536, device=dev).to(torch.bfloat16)     # ~ a mixed prefill's all-token pool block (33 MB)
big = torch.randn(8192, 8192, device=dev)
def t_enqueue(dst_fn, label, reps=10):
    enq, tot = [], []
    for _ in range(reps):
        dst = dst_fn()
        torch.cuda.synchronize()
        big @ big        # keep the stream busy so a synchronous copy would show
        t = time.perf_counter(); dst.copy_(src, non_blocking=True); e = time.perf_counter() - t
        torch.cuda.synchronize(); tot.append(time.perf_counter() - t); enq.append(e)
    print(f"{label}: enqueue {1e3*statistics.median(enq):.3f} ms, to done {1e3*statistics.median(tot):.3f} ms")
t_enqueue(lambda: arena.alloc(src.shape, src.dtype), "arena")
t_enqueue(lambda: torch.empty(src.shape, dtype=src.dtype, pin_memory=True), "torch pinned")
p = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
t_enqueue(lambda: p, "torch pinned reused")
t_enqueue(lambda: torch.empty(src.shape, dtype=src.dtype), "pageable")
src = src.float()
t_enqueue(lambda: arena.alloc(src.shape, src.dtype), "arena fp32")
# The collector's own host time for a prefill step's block (what the routing counter holds)
from vllm_hook.delivery.collector import Collector
from vllm_hook.routing import StepRouting
pools = [torch.zeros(16384, 4 * 1536, dtype=torch.bfloat16, device=dev)]
col = Collector(pools, lambda *a, **k: None, arena_bytes=2 << 30)
ts = []
for _ in range(10):
    big @ big
    r = StepRouting.__new__(StepRouting)
    try:
        r.segments, r.pool_used = [], {0: 2730}
        t = time.perf_counter()
        blocks = {0: col.pools[0][:2730]}
        arena = col._arena_for(2730 * 4 * 1536 * 2)
        h = col._to_host(blocks[0], arena)
        ts.append(time.perf_counter() - t)
    except Exception as e:
        print("collector check failed", e); break
    torch.cuda.synchronize()
print("collector _to_host of 2730 rows x 4 layers:", [round(1e3 * x, 3) for x in ts], "ms")
