"""What hooks save: RowLog pieces through encode/decode, and the logit lens's chunked top-k."""

import os
import subprocess
import sys

import pytest
import torch

from vllm_hook.hooks.builtin import _chunks, topk_logprobs
from vllm_hook.hooks.context import BatchHookContext, HookContext
from vllm_hook.hooks.state import RowLog, StateError, decode, encode, merge_stages, nbytes, to_host


def _batch(n_requests: int, rows: list[int]) -> BatchHookContext:
    reqs = [HookContext(f"r{i}", 4, None) for i in range(n_requests)]
    segs, at = [], 0
    for n in rows:
        segs.append((at, n))
        at += n
    return BatchHookContext(reqs, segs, 1, False, None, num_layers=4)


def test_batched_saves_arrive_per_request_per_call():
    ctx = _batch(3, [2, 1, 3])
    calls = [torch.randn(6, 5), torch.randn(6, 5)]
    for t in calls:
        ctx.save("x", t)
    ctx.save("last", torch.arange(3.0)[:, None], per_request=True)
    saved = [c.saved for c in ctx.requests]
    assert isinstance(saved[0]["x"], RowLog) and len(saved[0]["x"]) == 2
    assert nbytes(saved[2]) == (2 * 3 * 5 + 1) * 4
    tensors, structure = encode(saved, "h")
    assert len(tensors) <= 2                      # one tensor per dtype and row shape
    back = decode(structure, tensors)
    for i, (a, n) in enumerate(ctx.segments):
        assert [t.shape for t in back[i]["x"]] == [(n, 5), (n, 5)]
        for t, ref in zip(back[i]["x"], calls):
            assert torch.equal(t, ref[a:a + n])
        assert back[i]["last"] == [torch.tensor([[float(i)]])]
    again = decode(*reversed(encode(back, "g")))   # decoded lists encode like any list
    assert torch.equal(torch.cat(again[1]["x"]), torch.cat([c[2:3] for c in calls]))


def test_save_refuses_wrong_rows_and_mixed_shapes():
    ctx = _batch(2, [1, 1])
    with pytest.raises(ValueError, match="3 rows, this call has 2"):
        ctx.save("x", torch.zeros(3, 4))
    ctx.save("x", torch.zeros(2, 4))
    with pytest.raises(StateError, match="one key keeps one dtype and row shape"):
        ctx.save("x", torch.zeros(2, 5))
    ctx.requests[0].saved["y"] = []
    with pytest.raises(StateError, match="ctx.save keeps its own keys"):
        ctx.save("y", torch.zeros(2, 4))
    one = HookContext("r", 3, None)
    one.save("s", torch.tensor(2.0))
    assert decode(*reversed(encode([one.saved], "p")))[0]["s"] == [torch.tensor([2.0])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="to_host copies device tensors")
def test_to_host_keeps_rowlogs_whole():
    ctx = _batch(2, [1, 2])
    ctx.requests[0].saved["plain"] = torch.ones(2, device="cuda")
    ctx.save("x", torch.randn(3, 4, device="cuda"))
    trees, event = to_host([c.saved for c in ctx.requests])
    event.synchronize()
    back = decode(*reversed(encode(trees, "h")))
    assert back[1]["x"][0].shape == (2, 4) and back[0]["plain"].device.type == "cpu"


def test_to_host_of_call_logs_equals_their_views(monkeypatch):
    """The copy to the host (run here on CPU tensors taken for device ones): a CallLog of
    uniform calls goes as one stacked block per member; the rows and per-call counts equal
    the per-call views, with a prompt chunk's call before them and a plain tensor beside."""
    from vllm_hook.hooks import state
    from vllm_hook.hooks.state import CtxList

    monkeypatch.setattr(state, "_device", lambda x: "cuda")
    reqs = [HookContext(f"r{i}", 3, None) for i in range(3)]
    group = CtxList(reqs, epochs={}, key="k")
    prompt = BatchHookContext(group, [(0, 2), (2, 3), (5, 1)], 1, False, None)
    prompt.save("x", torch.randn(6, 4))
    steady = CtxList(reqs, epochs={}, key="k2")
    offsets = [(0, 1), (1, 1), (2, 1)]
    for _ in range(5):
        BatchHookContext(steady, offsets, 1, False, None).save("y", torch.randn(3, 4))
    # One CallLog that starts with the last prompt chunks and goes on in steady decode.
    mixed = CtxList(reqs, epochs={}, key="k3")
    BatchHookContext(mixed, [(0, 2), (2, 1), (3, 4)], 1, False, None).save("z", torch.randn(7, 4))
    for _ in range(4):
        BatchHookContext(mixed, offsets, 1, False, None).save("z", torch.randn(3, 4))
    reqs[1].saved["plain"] = torch.arange(3.0)
    keys = ("x", "y", "z")
    ref = [{k: [v.clone() for v in c.saved[k].views()] for k in keys} for c in reqs]
    assert steady.logs()["y"].since == 0 and mixed.logs()["z"].since == 1
    trees, event = to_host([c.saved for c in reqs])
    assert event is None
    back = decode(*reversed(encode(trees, "h")))
    for got, want in zip(back, ref):
        for k in keys:
            assert len(got[k]) == len(want[k]) and all(torch.equal(a, b) for a, b in zip(got[k], want[k]))
    assert torch.equal(back[1]["plain"], torch.arange(3.0))


@pytest.mark.parametrize("v,k,chunks", [(4096, 5, 16), (4096, 16, 64), (6000, 3, 16)])
def test_chunked_topk_logprobs_equal_the_plain_ones(v, k, chunks):
    g = torch.Generator().manual_seed(v + k)
    logits = torch.randn(7, v, generator=g) * 4
    if v % chunks:
        with pytest.raises(ValueError, match="must divide the vocabulary"):
            topk_logprobs(logits, k, chunks=chunks)
        return
    ids, lps = topk_logprobs(logits, k, chunks=chunks)
    ref_ids, ref_lps = topk_logprobs(logits, k, chunks=1)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(lps, ref_lps, atol=1e-5)
    assert torch.allclose(lps, logits.log_softmax(-1).gather(1, ids), atol=1e-5)


def test_triton_kernels_equal_the_plain_ones():
    """The GPU path's kernels (`hooks/kernels.py`), run by Triton's interpreter on the
    CPU (in a subprocess: the interpreter is chosen when the module is imported)."""
    pytest.importorskip("triton")
    code = """
import torch
from vllm_hook.hooks import kernels as tk
for n, v, k in [(3, 5000, 5), (2, 2048, 1), (1, 9, 9), (2, 4097, 16), (0, 100, 3)]:
    z = (torch.randn(n, v, generator=torch.Generator().manual_seed(v)) * 3).to(torch.bfloat16)
    ids, lps = tk.topk_logprobs(z, k)
    ref = z.float().log_softmax(-1).topk(k, -1)
    zf = z.float()
    assert ids.shape == lps.shape == (n, k) and ids.dtype == torch.int64 and lps.dtype == torch.float32
    assert torch.equal(zf.gather(1, ids), zf.gather(1, ref.indices)), (n, v, k)     # ids up to ties
    assert torch.allclose(lps, ref.values, atol=1e-5), (n, v, k)
from vllm_hook.adapters.params import _direct_rms_norm
class RMSNorm(torch.nn.Module):          # the attributes _direct_rms_norm reads of vLLM's
    def __init__(self, w):
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(w), 1e-6
g = torch.Generator().manual_seed(0)
x = (torch.randn(5, 300, generator=g) * 4).to(torch.bfloat16)
for w in (torch.randn(300, generator=g).to(torch.bfloat16), torch.randn(300, generator=g)):
    ref = _direct_rms_norm(RMSNorm(w))(x)              # torch's path (CPU)
    got = tk._norm(x, w, 1e-6)
    # Within 2 bf16 steps: the interpreter rounds to bf16 its own way (on the GPU the two
    # paths agree to 1 step; docs/benchmarks.md, run 52).
    assert got.dtype == x.dtype and torch.allclose(got.float(), ref.float(), rtol=2 ** -6, atol=1e-3)
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_kernels_that_fail_to_build_leave_the_torch_path(monkeypatch):
    """A worker with hook layers builds the lens's kernels at start; where that fails (here: no
    GPU) the lens keeps torch's path instead of failing the engine."""
    kernels = pytest.importorskip("vllm_hook.hooks.kernels")
    pytest.importorskip("triton")
    monkeypatch.setattr(kernels, "triton", kernels.triton)          # restored afterwards
    kernels.warm(torch.device("cpu"), torch.bfloat16, 8, 64)         # the CPU: nothing to build
    assert kernels.triton is not None
    kernels.warm(torch.device("cuda"), torch.bfloat16, 8, 64)        # no CUDA here: the build fails
    assert kernels.triton is None and not kernels.available(torch.zeros(2, 64), 5)
    logits = torch.randn(3, 64)
    assert torch.equal(topk_logprobs(logits, 5)[0], logits.log_softmax(-1).topk(5, -1).indices)


def test_chunk_count():
    assert _chunks(151936, 5) == 128 and _chunks(128256, 5) == 256 and _chunks(32000, 5) == 256
    assert _chunks(512, 5) == 256 and _chunks(1000, 5) == 1 and _chunks(4096, 300) == 1


def test_lens_blocks_of_rows_equal_one_block(monkeypatch):
    from vllm_hook.hooks import builtin

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(37, 16, generator=g), torch.randn(300, 16, generator=g)
    whole = builtin._lens(x, w, 4)
    monkeypatch.setattr(builtin, "LENS_BLOCK_BYTES", 6 * 300 * 5)      # 5 rows a block
    blocks = builtin._lens(x, w, 4)
    assert torch.equal(whole[0], blocks[0]) and torch.allclose(whole[1], blocks[1])


def test_pipeline_stages_saved_dicts_merge():
    """Each stage runs a hook at its own layers: lists (ctx.save) join in stage order, dicts
    merge key by key, any other value a later stage set under a taken key keeps its own key."""
    a, b, c = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    s0 = [{"h": [a], "first": 1, "d": {"x": [a], "y": 1}}, {}]
    s1 = [{"h": [b, c], "first": 2, "d": {"x": [b], "y": 2}, "only": "s1"}, {"k": [c]}, {"n": 3}]
    got = merge_stages([s0, s1])
    assert [t.item() for t in got[0]["h"]] == [1.0, 0.0, 2.0]
    assert got[0]["first"] == 1 and got[0]["first@stage1"] == 2 and got[0]["only"] == "s1"
    assert [t.item() for t in got[0]["d"]["x"]] == [1.0, 0.0]
    assert got[0]["d"]["y"] == 1 and got[0]["d"]["y@stage1"] == 2
    assert got[1] == {"k": [c]} and got[2] == {"n": 3}
    assert s0[0]["h"] == [a] and s0[0]["d"] == {"x": [a], "y": 1}      # the stages' dicts untouched
    assert merge_stages([s0]) is s0
