"""Triton kernels of the logit lens on a GPU: top-k log-probabilities of logit rows, and
the final RMS norm in one kernel.

In torch, top-k and log-sum-exp over a 152k vocabulary take about ten kernels and several
passes over the logits: 0.37 ms for the 256 rows of a 4-layer lens at 64 requests on the
H200, twice the product with `lm_head` that made them (docs/benchmarks.md, run 52). Here:
one pass over the logits, a program per (row, chunk) keeping the chunk's max and sum of exps;
then a program per (row, j) takes the top k of the chunk with the j-th largest max (the row's
top k lie in those k chunks); then a program per row merges the k x k candidates. Only for
k <= MAX_K (each top k is k reductions); `topk_logprobs` in `builtin.py` falls back to torch.

The RMS norm in torch is eight kernels and about 90 µs of host time per call at the lens's
rows (`adapters/params.py` uses this one on CUDA tensors).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("vllm_hook")
MAX_K = 16
BLOCK = 2048                   # vocabulary entries per (row, chunk) program

try:
    import triton
    import triton.language as tl
except ImportError:           # no Triton: torch's path only
    triton = None


if triton is not None:
    @triton.jit
    def _stats(z, stride, V, C, m_out, s_out, BLOCK: tl.constexpr):
        """Program (row, chunk): the chunk's max and sum of exp(x - max)."""
        row, c = tl.program_id(0), tl.program_id(1)
        at = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(z + row.to(tl.int64) * stride + at, mask=at < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        tl.store(m_out + row * C + c, m)
        tl.store(s_out + row * C + c, tl.sum(tl.exp(x - m), 0))

    @triton.jit
    def _candidates(z, stride, V, C, m_in, s_in, lse_out, v_out, i_out,
                    K: tl.constexpr, BLOCK: tl.constexpr, BC: tl.constexpr):
        """Program (row, j): the top k of the row's chunk with the j-th largest max (the top k
        of the row lie in its k chunks of largest maxima); j = 0 also the row's log-sum-exp."""
        row, j = tl.program_id(0), tl.program_id(1)
        oc = tl.arange(0, BC)
        m = tl.load(m_in + row * C + oc, mask=oc < C, other=float("-inf"))
        if j == 0:
            s = tl.load(s_in + row * C + oc, mask=oc < C, other=0.0)
            mx = tl.max(m, 0)
            tl.store(lse_out + row, mx + tl.log(tl.sum(s * tl.exp(m - mx), 0)))
        pick = 0
        for t in tl.static_range(K):
            _, i = tl.max(m, 0, return_indices=True)
            pick = tl.where(t == j, i, pick)
            m = tl.where(oc == i, float("-inf"), m)
        offs = tl.arange(0, BLOCK)
        at = pick * BLOCK + offs
        end = tl.where(j < C, V, 0)        # fewer chunks than k: the extra programs read nothing
        x = tl.load(z + row.to(tl.int64) * stride + at, mask=at < end, other=float("-inf")).to(tl.float32)
        o = (row * K + j) * K
        for t in tl.static_range(K):
            v, i = tl.max(x, 0, return_indices=True)
            tl.store(v_out + o + t, v)
            tl.store(i_out + o + t, pick * BLOCK + i)
            x = tl.where(offs == i, float("-inf"), x)

    @triton.jit
    def _merge(lse_in, v_in, i_in, ids_out, lp_out, K: tl.constexpr, BKK: tl.constexpr):
        """Program row: the top k of its k x k candidates, as log-probabilities."""
        row = tl.program_id(0)
        ok = tl.arange(0, BKK)
        v = tl.load(v_in + row * K * K + ok, mask=ok < K * K, other=float("-inf"))
        idx = tl.load(i_in + row * K * K + ok, mask=ok < K * K, other=0)
        lse = tl.load(lse_in + row)
        for t in tl.static_range(K):
            best, at = tl.max(v, 0, return_indices=True)
            tl.store(lp_out + row * K + t, best - lse)
            tl.store(ids_out + row * K + t, tl.sum(tl.where(ok == at, idx, 0), 0))
            v = tl.where(ok == at, float("-inf"), v)


    @triton.jit
    def _rms_norm(x, w, out, H, eps, ROUND: tl.constexpr, BLOCK: tl.constexpr):
        """Program row: out = ((x * rsqrt(mean(x^2) + eps)) [rounded to x's dtype] * w) in
        x's dtype, the math in fp32 (vLLM's RMSNorm; Gemma's passes w + 1 in fp32, no rounding)."""
        row = tl.program_id(0).to(tl.int64)
        at = tl.arange(0, BLOCK)
        v = tl.load(x + row * H + at, mask=at < H, other=0.0)
        f = v.to(tl.float32)
        y = f * tl.rsqrt(tl.sum(f * f, 0) / H + eps)
        if ROUND:
            y = y.to(v.dtype).to(tl.float32)
        g = tl.load(w + at, mask=at < H, other=0.0).to(tl.float32)
        tl.store(out + row * H + at, (y * g).to(v.dtype), mask=at < H)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """vLLM's RMSNorm of `x` [rows, hidden] with `weight` (rounded to the weight's dtype before
    the product, as vLLM does, unless the weight is fp32), or None where the kernel does not
    apply (no Triton, a CPU tensor, a hidden size past 64k)."""
    if (triton is None or not x.is_cuda or x.dim() != 2 or x.shape[1] > 65536
            or weight.shape != (x.shape[1],) or weight.device != x.device
            or weight.dtype not in (torch.float32, x.dtype)):
        return None
    return _norm(x, weight, eps)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    if x.data_ptr() % 16:        # a view at an odd offset: another compiled variant otherwise
        x = x.clone()
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm[(x.shape[0],)](x, weight, out, x.shape[1], eps, ROUND=weight.dtype != torch.float32,
                                 BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4)
    return out


def warm(device: torch.device, dtype: torch.dtype, hidden: int, vocab: int, k: int = 5) -> None:
    """Compile the kernels for this model's shapes (the logit lens's default k) when a worker
    with hook layers starts: a first call compiles them, about 2 s on the H200 host (run 52),
    which would stall the engine's step that first runs a lens. Triton keeps them on disk, so
    a later start loads them. Nothing on the CPU."""
    global triton
    if triton is None or device.type != "cuda":
        return
    try:
        topk_logprobs(torch.zeros((1, vocab), dtype=dtype, device=device), k)
        rms_norm(torch.zeros((1, hidden), dtype=dtype, device=device), torch.ones(hidden, dtype=dtype, device=device),
                 1e-6)
    except Exception:           # a GPU Triton cannot build for: torch's path, as without Triton
        log.warning("vllm_hook: the logit lens's Triton kernels failed to build; using torch's", exc_info=True)
        triton = None


def _up16(n: int) -> int:
    return (n + 15) // 16 * 16


def available(logits: torch.Tensor, k: int) -> bool:
    """Whether the kernels can serve this call (a CUDA tensor, rows contiguous, k small)."""
    return (triton is not None and logits.is_cuda and logits.dim() == 2 and 1 <= k <= MAX_K
            and logits.shape[1] >= k and logits.stride(1) == 1)


def topk_logprobs(logits: torch.Tensor, k: int, block: int = BLOCK,
                  warps: tuple[int, int] = (4, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64, log-probabilities fp32) of the k largest entries of each row of `logits`
    [rows, vocab]; the same as log_softmax then topk, up to fp32 rounding and ties. `block`
    and `warps` (of the first two kernels) are tuning knobs (benchmarks/lens_gpu.py)."""
    n, v = logits.shape
    c = triton.cdiv(v, block)
    dev = logits.device
    # One scratch allocation; each part starts on a 64-byte boundary, as a fresh tensor would:
    # Triton compiles a variant per pointer alignment, so unaligned parts would compile again
    # (seconds) for row counts that `warm` did not see.
    a, b = _up16(n * c), _up16(n)
    tmp = torch.empty(2 * a + b + n * k * k, dtype=torch.float32, device=dev)
    ci = torch.empty(n * k * k, dtype=torch.int64, device=dev)
    ids = torch.empty((n, k), dtype=torch.int64, device=dev)
    lps = torch.empty((n, k), dtype=torch.float32, device=dev)
    if n == 0:
        return ids, lps
    m, s, lse, cv = tmp[:a], tmp[a:2 * a], tmp[2 * a:2 * a + b], tmp[2 * a + b:]
    z, stride = logits, logits.stride(0)
    _stats[(n, c)](z, stride, v, c, m, s, BLOCK=block, num_warps=warps[0])
    _candidates[(n, k)](z, stride, v, c, m, s, lse, cv, ci, K=k, BLOCK=block,
                        BC=triton.next_power_of_2(c), num_warps=warps[1])
    _merge[(n,)](lse, cv, ci, ids, lps, K=k, BKK=triton.next_power_of_2(k * k), num_warps=1)
    return ids, lps
