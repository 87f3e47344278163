"""Soak: 5,000 mixed requests against a real server (captures inline and by handle, steering by
name, plain requests, chat, streams aborted mid-way, 8 at a time). Every server process's
RSS must have no slope after warm-up: a linear fit over the second half, in KiB per request,
within SLOPE_KIB. Nothing may stay retained or pending, and repeated requests keep their
results.

The server runs with oneDNN's primitive cache off: on the CPU that cache grows the worker by
10-17 KiB per request for thousands of requests with the plugin disabled too (native vLLM,
measured in docs/reliability.md), which would hide anything the plugin does.
"""

from __future__ import annotations

import asyncio
import glob
import json
import time

import httpx
import numpy as np
import psutil
import pytest

import vllm_hook
from tests.helpers.common import random_prompts, vec
from tests.helpers.server import API_KEY, serving
from vllm_hook.testing.tiny_models import tiny_model

pytestmark = pytest.mark.server
N = 5000
CONCURRENCY = 8
SAMPLE_EVERY = 250
SLOPE_KIB = 1.0          # per process; measured 0.03-0.25 (docs/reliability.md)
CONFIG = {"sites": ["resid_post", "resid_pre", "attn_out", "q"], "projection_layers": "all",
          "max_inline_result_bytes": 4096}
ONEDNN_CACHE_OFF = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "DNNL_PRIMITIVE_CACHE_CAPACITY": "0"}
TEXTS = random_prompts(64, seed=3)


def _spec(i: int):
    k = i % 5
    if k == 0:   # all layers, all tokens: beyond the inline bound, fetched by handle
        return {"capture": [{"layers": "all", "tokens": "all"}]}
    if k == 1:
        return {"steer": [{"op": "add", "layer": 1, "vector": "calm", "scale": 2.0}]}
    if k == 2:
        return None
    if k == 3:
        return {"capture": [{"layers": [0, 3], "tokens": "last_prompt"},
                            {"layers": [1], "site": "attn_scores"}]}
    return {"steer": [{"op": "ablate", "layer": 2, "vector": "calm"}],
            "capture": [{"layers": [2], "site": "attn_out", "tokens": "generated"}]}


def _tree_rss(pid: int) -> dict[str, int]:
    """RSS in KiB of the server and its children, by process name (vLLM names its own)."""
    p = psutil.Process(pid)
    out = {}
    for q in [p] + p.children(recursive=True):
        try:
            out[f"{q.name()}[{q.pid}]"] = q.memory_info().rss // 1024
        except psutil.Error:
            pass
    return out


async def _abort_a_stream(url: str, text: str) -> None:
    """A streamed, capturing request whose client goes away after the first event. Its capture
    is small (inline): a by-handle result of a client that left is kept for it until
    result_ttl_s, as any unfetched handle (under load the server often finishes the stream
    into the closed connection before it notices), which this test's end state would count."""
    spec = {"capture": [{"layers": [1, 2], "tokens": "last_prompt"}]}
    body = {"model": tiny_model("qwen2"), "prompt": text, "max_tokens": 64, "stream": True, "temperature": 0,
            "vllm_xargs": {"vllm_hook": json.dumps(spec)}}
    async with httpx.AsyncClient(timeout=60) as hc:
        async with hc.stream("POST", f"{url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                break


async def _soak(url: str, pid: int, start: int, stop: int):
    samples, first, done = [], {}, start
    async with vllm_hook.AsyncClient(url, api_key=API_KEY) as ac:
        await ac.register_vectors({"calm": vec(1)})
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(i):
            nonlocal done
            async with sem:
                spec, text = _spec(i), TEXTS[i % len(TEXTS)]
                if i % 97 == 0:
                    await _abort_a_stream(url, text)
                elif i % 7 == 0:
                    g = await ac.chat([{"role": "user", "content": text}], spec, max_tokens=4, temperature=0)
                    assert spec is None or g.results.ok, (i, g.results.errors)
                else:
                    g = await ac.generate(text, spec, max_tokens=4, temperature=0)
                    if spec is not None:
                        assert g.results.ok, (i, g.results.errors)
                        _same_as_first(first, (i % 5, i % len(TEXTS)), g.results)
                done += 1

        for at in range(start, stop, SAMPLE_EVERY):
            await asyncio.gather(*(one(i) for i in range(at, min(stop, at + SAMPLE_EVERY))))
            samples.append((done, _tree_rss(pid)))
        health = await ac.health()
    return samples, health


def _same_as_first(first: dict, key, r: vllm_hook.Results) -> None:
    """A repeated request (same prompt and spec) keeps its tokens and, within fp32 batch noise,
    its captures, whatever else was in the batch."""
    if key not in first:
        first[key] = r
        return
    ref = first[key]
    assert r.token_ids == ref.token_ids, key
    for site, by_layer in ref.activations.items():
        for L, t in by_layer.items():
            got = r.activations[site][L]
            assert got.shape == t.shape, (key, site, L)
            scale = float(t.abs().max().clamp_min(1e-30))
            assert float((got - t).abs().max()) / scale < 1e-4, (key, site, L)


@pytest.fixture
def no_engine(engines):
    engines.close()          # one vLLM engine at a time on a 2-core box


def _slopes(samples: list, name: str) -> list[float] | None:
    """KiB per request of a linear fit over `samples` and over each of its halves."""
    pts = [(n, rss[name]) for n, rss in samples if name in rss]
    if len(pts) < 6:
        return None
    return [float(np.polyfit(*zip(*w), 1)[0]) for w in (pts, pts[:len(pts) // 2], pts[len(pts) // 2:])]


def test_soak_5000_mixed_requests_keep_memory_flat(no_engine):
    with serving(CONFIG, env_extra=ONEDNN_CACHE_OFF) as srv:
        t0 = time.monotonic()
        samples, health = asyncio.run(_soak(srv.url, srv.proc.pid, 0, N))
        elapsed = time.monotonic() - t0
        assert health["retained_results"]["count"] == 0 and health["pending_requests"] == 0, health
        w = health["workers"][0]
        assert w["results_waiting"] == 0 and w["retained_bytes"] == 0 and w["capture_bytes_in_flight"] == 0, w
        left = [f for f in glob.glob("/dev/shm/vllm_hook-*") if "-probe-" not in f and "-free-" not in f]
        assert not left, left[:3]
        half = samples[len(samples) // 2:]
        print(f"\n[soak] {N} requests in {elapsed:.0f} s; RSS KiB at request "
              f"{samples[0][0]} -> {samples[-1][0]}, slope over the second half:")
        # A leak grows in every window; a one-off step (an allocator arena, a cache filling
        # once) lifts one. A process is suspect when the second half's slope and both of its
        # halves' are over the bound (runs here: usually 0.1-0.3; CI once read 1.49, halves
        # 1.73 and 1.20, on the worker); a suspect fails only if it keeps growing over the
        # bound through N / 2 more requests: a bounded cache or arena filling has stopped by
        # then, a leak has not.
        suspects = []
        for name in samples[-1][1]:
            slopes = _slopes(half, name)
            if slopes is None:
                continue
            print(f"  {name}: {samples[0][1].get(name)} -> {samples[-1][1][name]}, {slopes[0]:.3f} KiB/request "
                  f"(halves {slopes[1]:.3f}, {slopes[2]:.3f})")
            if min(slopes) > SLOPE_KIB:
                suspects.append(name)
        if not suspects:
            return
        more, _ = asyncio.run(_soak(srv.url, srv.proc.pid, N, N + N // 2))
    steep = []
    for name in suspects:
        slopes = _slopes(samples[-1:] + more, name)
        print(f"  {name}, {N // 2} more requests: {samples[-1][1][name]} -> {more[-1][1].get(name)}, "
              f"{slopes[0]:.3f} KiB/request (halves {slopes[1]:.3f}, {slopes[2]:.3f})")
        if slopes[0] > SLOPE_KIB:
            steep.append(f"{name}: {slopes[0]:.2f} KiB/request over {N // 2} more requests")
    assert not steep, steep
