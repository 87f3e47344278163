"""Served mode on a real `vllm serve` (one subprocess for the module, CPU, eager).

Offline references come first, from an in-process engine with the same settings, which is
shut down before the server starts (one engine at a time). Over HTTP, captures must equal the
offline ones (rel. 1e-5, identical positions and tokens) whatever else runs concurrently;
bad specs get 400/404/413 and the server keeps serving; retained results stay bounded.
"""

from __future__ import annotations

import asyncio
import base64
import glob
import json
import math
import os
import time

import httpx
import pytest
import torch

import vllm_hook
from tests.helpers.common import rel_err, res, run, sp, vec
from tests.helpers.server import API_KEY, serving
from vllm_hook.delivery.spill import KEEP_FREE_BYTES
from vllm_hook.server.encode import shown_tokens
from vllm_hook.server.store import ResultStore
from vllm_hook.testing.tiny_models import tiny_model

pytestmark = pytest.mark.server

TOL = 1e-5
H = 128
INLINE = 4096            # max_inline_result_bytes of the test server: bigger results go by handle
MAX_BODY = 1 << 20       # max_request_bytes of the test server
HOOK_CONFIG = {"max_inline_result_bytes": INLINE, "max_request_bytes": MAX_BODY,
               "max_capture_bytes_per_request": 1 << 20,
               "sites": ["resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k"], "projection_layers": "all",
               "hook_layers": "all", "hook_modules": ["tests.helpers.operator_hooks"]}
ENGINE = dict(dtype="float32", max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=64 << 20)

P1 = [11, 52, 97, 140, 201, 33, 77, 260, 301, 19, 45]
P2 = [300, 12, 8, 99, 150, 151, 152, 40]
P3 = [7, 70, 170, 270, 370, 470, 17, 27, 37]
CHAT = [{"role": "user", "content": "Please write a short poem about the sea"}]
ALL_SITES = ("resid_post", "resid_pre", "attn_out", "mlp_out")


def _steer(op: str, layer: int, seed: int, **kw) -> dict:
    return {"op": op, "layer": layer, "vector": vec(seed).tolist(), **kw}


# name -> (prompt ids, spec, max_tokens). Each is run solo offline; over HTTP, alone or mixed.
CASES = {
    "capture_all": (P1, {"capture": [{"layers": "all", "site": s} for s in ALL_SITES]}, 6),
    # every token, each point read once: the build hands on the worker's lent parts unjoined
    "capture_every_token": (P3, {"capture": [{"layers": "all", "site": s, "tokens": "all"}
                                             for s in ("resid_post", "attn_out", "mlp_out")]}, 12),
    "capture_last_prompt": (P2, {"capture": [{"layers": [1, -1], "tokens": "last_prompt"}]}, 4),
    "capture_generated": (P3, {"capture": [{"layers": [2], "site": "mlp_out", "tokens": "generated"}]}, 5),
    "capture_positions": (P1, {"capture": [{"layers": [0, 3], "site": "attn_out", "tokens": [0, 2, -1]}]}, 3),
    "steer_add": (P2, {"steer": [_steer("add", 1, 1, scale=4.0)],
                       "capture": [{"layers": [1, 2]}]}, 6),
    "steer_norm_match": (P3, {"steer": [_steer("add", 2, 2, scale=0.5, norm_match=True)],
                              "capture": [{"layers": [3], "tokens": "last"}]}, 6),
    "steer_cap_ablate": (P1, {"steer": [_steer("cap", 1, 3, min=-0.05, max=0.05),
                                        _steer("ablate", 2, 4, scale=0.0)],
                              "capture": [{"layers": [2], "site": "resid_pre"}]}, 6),
    "steer_named": (P2, {"steer": [{"op": "add", "layer": 0, "vector": "calm", "scale": 6.0,
                                    "tokens": "generated"}],
                         "capture": [{"layers": [0], "tokens": "all"}]}, 6),
}
NAMED = {"calm": vec(9)}


# ---- offline references, then the server --------------------------------------------------

@pytest.fixture(scope="module")
def refs(engines):
    """Offline results of every case, each generated alone (and the chat case)."""
    llm = engines.get("serve-ref", **ENGINE)
    vllm_hook.register_vectors(llm, NAMED)
    out = {}
    for name, (ids, spec, n) in CASES.items():
        o = run(llm, [ids], [sp(spec, max_tokens=n)])[0]
        out[name] = (list(o.outputs[0].token_ids), res(o))
    chat_spec = CASES["capture_all"][1]
    o = llm.chat(CHAT, sp(chat_spec, max_tokens=5), use_tqdm=False)[0]
    out["chat"] = (list(o.outputs[0].token_ids), res(o))
    engines.close()     # the server gets the CPU to itself
    return out


@pytest.fixture(scope="module")
def server(refs):
    with serving(HOOK_CONFIG) as srv:
        with vllm_hook.Client(srv.url, api_key=API_KEY) as c:
            c.register_vectors(NAMED)
        yield srv


@pytest.fixture
def client(server):
    with vllm_hook.Client(server.url, api_key=API_KEY) as c:
        yield c


def _same(got: vllm_hook.Results, ref: vllm_hook.Results, what: str) -> None:
    assert got.errors == [], f"{what}: {got.errors}"
    assert got.token_ids == ref.token_ids, f"{what}: tokens differ"
    assert got.prompt_len == ref.prompt_len
    assert set(got.activations) == set(ref.activations)
    for site, layers in ref.activations.items():
        assert set(got.activations[site]) == set(layers), f"{what} {site}: layers differ"
        for L, t in layers.items():
            g = got.activations[site][L]
            assert g.dtype == torch.float32 and g.shape == t.shape, f"{what} {site}.{L}: shape"
            assert torch.equal(got.positions[site][L], ref.positions[site][L]), f"{what} {site}.{L}"
            if t.numel():
                err = rel_err(g, t)
                assert err <= TOL, f"{what} {site}.{L}: rel err {err:.2e}"


def _check_case(name: str, gen, refs) -> None:
    tokens, ref = refs[name]
    assert gen.token_ids == tokens, f"{name}: generated {gen.token_ids} != offline {tokens}"
    _same(gen.results, ref, name)


def _good_request_works(client) -> None:
    ids, spec, n = CASES["capture_last_prompt"]
    out = client.generate(ids, spec, max_tokens=1, temperature=0)
    assert out.results is not None and out.results.ok


# ---- results over HTTP equal offline --------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_http_equals_offline(client, refs, name):
    ids, spec, n = CASES[name]
    out = client.generate(ids, spec, max_tokens=n, temperature=0)
    _check_case(name, out, refs)


def test_large_results_travel_by_handle_and_are_deleted(server, client, refs):
    """A result too large to inline is kept by handle. The plugin's client, on the server's
    host, reads it from its file in /dev/shm and releases it; with `local_results=False`, or
    a client that does not ask (no "local" in its accept header), it goes over HTTP. Either
    way it equals the offline result, and nothing is left on the server."""
    ids, spec, n = CASES["capture_all"]
    head = {"Authorization": f"Bearer {API_KEY}"}
    for local in (True, False):
        with vllm_hook.Client(server.url, api_key=API_KEY, local_results=local) as c:
            out = c.generate(ids, spec, max_tokens=n, temperature=0)
        entry = out.raw["vllm_hook"]["results"][0]
        assert entry["data"] is None and entry["handle"] and entry["bytes"] > INLINE
        assert bool(entry.get("local")) is local, entry
        if local:
            assert entry["local"].startswith("/dev/shm/vllm-hook-result-") and not os.path.exists(entry["local"])
        _check_case("capture_all", out, refs)
        # The client fetched or released the handle: deleted.
        assert httpx.get(f"{server.url}/v1/hook/results/{entry['handle']}", headers=head).status_code == 404
    # Every-token rows the worker lent as a prompt block and decode runs are written to the
    # result's file (or its bytes) from those parts, never joined on the event loop
    ids, spec, n = CASES["capture_every_token"]
    before = httpx.get(f"{server.url}/v1/hook/health", headers=head).json()["frontend"]["results_from_parts"]
    for local in (True, False):
        with vllm_hook.Client(server.url, api_key=API_KEY, local_results=local) as c:
            out = c.generate(ids, spec, max_tokens=n, temperature=0)
        assert bool(out.raw["vllm_hook"]["results"][0].get("local")) is local
        _check_case("capture_every_token", out, refs)
    after = httpx.get(f"{server.url}/v1/hook/health", headers=head).json()["frontend"]["results_from_parts"]
    assert after == before + 2, (before, after)
    ids, spec, n = CASES["capture_all"]
    # AsyncClient: concurrent responses' files read, their handles released in the
    # background (`release_pending`, or closing the client, waits; the event loop's end
    # releases what is left)
    async def concurrent():
        async with vllm_hook.AsyncClient(server.url, api_key=API_KEY, local_results=True) as ac:
            outs = await asyncio.gather(*(ac.generate(ids, spec, max_tokens=n, temperature=0) for _ in range(4)))
            await ac.release_pending()
            gone = [e for o in outs for e in o.raw["vllm_hook"]["results"]]
            late = await asyncio.gather(*(ac.generate(ids, spec, max_tokens=n, temperature=0) for _ in range(3)))
        return outs + late, gone, [e for o in late for e in o.raw["vllm_hook"]["results"]]
    async def left_open():                  # the loop ends first: released as it ends
        ac = vllm_hook.AsyncClient(server.url, api_key=API_KEY, local_results=True)
        return await ac.generate(ids, spec, max_tokens=n, temperature=0)
    async def cancelled_at_once():           # its release task cancelled before its first step
        ac = vllm_hook.AsyncClient(server.url, api_key=API_KEY, local_results=True)
        out = await ac.generate(ids, spec, max_tokens=n, temperature=0)
        ac._releasing.cancel()
        await asyncio.sleep(0.1)
        return out
    outs, released, closed = asyncio.run(concurrent())
    outs += [asyncio.run(left_open()), asyncio.run(cancelled_at_once())]
    closed += [e for o in outs[-2:] for e in o.raw["vllm_hook"]["results"]]
    for out in outs:
        _check_case("capture_all", out, refs)
    for entry in released + closed:           # the second lot released by closing the client
        assert entry["local"] and not os.path.exists(entry["local"])
        assert httpx.get(f"{server.url}/v1/hook/results/{entry['handle']}", headers=head).status_code == 404
    # Asked for by a client that cannot read the file (another host): fetched over HTTP.
    body = {"model": tiny_model("qwen2"), "prompt": ids, "max_tokens": n, "temperature": 0,
            "vllm_xargs": {"vllm_hook": json.dumps(spec)}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={**head, "x-vllm-hook-accept": "local"},
                   timeout=120)
    (entry,) = r.json()["vllm_hook"]["results"]
    assert os.stat(entry["local"]).st_mode & 0o777 == 0o600
    data = httpx.get(f"{server.url}/v1/hook/results/{entry['handle']}?delete=true", headers=head).content
    assert len(data) == entry["bytes"] and not os.path.exists(entry["local"])
    _same(vllm_hook.Results.from_bytes(data), refs["capture_all"][1], "local entry over HTTP")
    # Release: bad bodies are 400s; unknown handles count as not released
    rel = f"{server.url}/v1/hook/results/release"
    assert httpx.post(rel, json={"handles": "x"}, headers=head).status_code == 400
    assert httpx.post(rel, json={"handles": ["nope"]}, headers=head).json() == {"released": 0}
    assert httpx.get(f"{server.url}/v1/hook/health", headers=head).json()["retained_results"]["as_files"] == 0


def test_small_results_travel_inline(client):
    ids, spec, _ = CASES["capture_last_prompt"]
    out = client.generate(ids, spec, max_tokens=2, temperature=0)
    entry = out.raw["vllm_hook"]["results"][0]
    assert entry["handle"] is None and entry["data"] and entry["bytes"] <= INLINE
    assert entry["format"] == "safetensors" and entry["index"] == 0 and entry["errors"] == []


def test_stacked_sites_only_for_clients_that_read_them(server, client, refs):
    """The plugin's clients say they read stacked sites (`x-vllm-hook-accept: tokens,
    stacked`): a site's layers come as one tensor `{site}.*`, inline or by handle, streamed or
    not; a request without the header (curl, openai) gets `{site}.{layer}`. Both decode to
    the offline results."""
    from vllm_hook.delivery.store import st_tensors

    head = {"Authorization": f"Bearer {API_KEY}"}
    for name in ("capture_last_prompt", "capture_all"):          # inline; by handle
        ids, spec, n = CASES[name]
        out = client.generate(ids, spec, max_tokens=n, temperature=0)
        _check_case(name, out, refs)
        body = {"model": tiny_model("qwen2"), "prompt": ids, "max_tokens": n, "temperature": 0,
                "vllm_xargs": {"vllm_hook": json.dumps(spec)}}
        for accept, stacked in ((None, False), ("Tokens, stacked", True)):
            for stream in (False, True):
                h = {**head, **({"x-vllm-hook-accept": accept} if accept else {})}
                r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream}, headers=h, timeout=120)
                assert r.status_code == 200, r.text
                if stream:
                    events = [json.loads(line[5:]) for line in r.text.splitlines()
                              if line.startswith("data:") and "[DONE]" not in line]
                    (entry,) = [ev for ev in events if ev.get("object") == "vllm_hook.results"][0]["vllm_hook"]["results"]
                else:
                    (entry,) = r.json()["vllm_hook"]["results"]
                if entry["data"] is not None:
                    data = base64.b64decode(entry["data"])
                else:
                    data = httpx.get(f"{server.url}/v1/hook/results/{entry['handle']}?delete=true", headers=head).content
                names = set(st_tensors(data)[0])
                assert ("resid_post.*" in names) is stacked and ("resid_post.1" in names) is not stacked, (name, accept)
                _same(vllm_hook.Results.from_bytes(data), refs[name][1], f"{name} {accept} stream={stream}")


def test_handle_routes(server):
    """GET returns the safetensors bytes of Results.save; DELETE frees; both 404 afterwards."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    ids, spec, n = CASES["capture_all"]
    body = {"model": tiny_model("qwen2"), "prompt": ids, "max_tokens": 2, "temperature": 0,
            "vllm_xargs": {"vllm_hook": json.dumps(spec)}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    handle = r.json()["vllm_hook"]["results"][0]["handle"]
    got = httpx.get(f"{server.url}/v1/hook/results/{handle}", headers=auth)
    assert got.status_code == 200 and got.headers["content-type"] == "application/octet-stream"
    results = vllm_hook.Results.from_bytes(got.content)
    assert results.activations["resid_post"][0].shape == (len(ids) + 1, H)
    assert httpx.delete(f"{server.url}/v1/hook/results/{handle}", headers=auth).status_code == 200
    assert httpx.get(f"{server.url}/v1/hook/results/{handle}", headers=auth).status_code == 404
    # One round trip: fetched and deleted.
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=120)
    handle = r.json()["vllm_hook"]["results"][0]["handle"]
    got = httpx.get(f"{server.url}/v1/hook/results/{handle}?delete=true", headers=auth)
    assert got.status_code == 200 and vllm_hook.Results.from_bytes(got.content).activations["resid_post"][0].shape \
        == (len(ids) + 1, H)
    assert httpx.get(f"{server.url}/v1/hook/results/{handle}", headers=auth).status_code == 404
    assert httpx.delete(f"{server.url}/v1/hook/results/{handle}", headers=auth).status_code == 404


def test_clients_raise_not_found_with_a_reason(client):
    with pytest.raises(vllm_hook.NotFoundError, match="HTTP 404") as e:
        client._call("GET", "/v1/hook/results/no-such-handle")
    assert isinstance(e.value, LookupError) and "no-such-handle" in e.value.message
    with pytest.raises(vllm_hook.NotFoundError, match="is vllm-hook installed"):
        client._call("GET", "/v1/hook/no-such-route")
    with pytest.raises(vllm_hook.UnknownVectorError):       # a vector keeps its own class
        client.generate([5, 6], {"steer": [{"op": "add", "layer": 0, "vector": "nope"}]}, max_tokens=1)


def test_chat_with_openai_package_equals_offline(server, refs):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    spec = CASES["capture_all"][1]
    resp = oc.chat.completions.create(
        model=tiny_model("qwen2"), messages=CHAT, max_tokens=5, temperature=0,
        extra_body={"vllm_xargs": {"vllm_hook": json.dumps(spec)}, "return_token_ids": True})
    with vllm_hook.Client(server.url, api_key=API_KEY) as c:
        (got,) = c.results_of(resp)
    tokens, ref = refs["chat"]
    assert resp.choices[0].token_ids == tokens
    _same(got, ref, "chat")


def test_vllm_lens_style_arguments_over_http(server, client):
    """output_residual_stream and apply_steering_vectors (SteeringVector.to_json, a 3-D vector)
    in vllm_xargs through the plain openai client equal our spec."""
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    sv = vllm_hook.SteeringVector(activations=torch.stack([vec(40), vec(41), vec(42)])[None],
                                  layer_indices=[1], scale=2.0, position_indices=[1, 3, 5])
    resp = oc.completions.create(
        model=tiny_model("qwen2"), prompt=P2, max_tokens=3, temperature=0,
        extra_body={"vllm_xargs": {"output_residual_stream": [2],
                                   "apply_steering_vectors": json.dumps([sv.to_json()])},
                    "return_token_ids": True})
    (got,) = client.results_of(resp)
    ours = client.generate(P2, {"capture": [{"layers": [2], "tokens": "all"}], "steer": sv.ops()},
                           max_tokens=3, temperature=0)
    assert resp.choices[0].token_ids == ours.token_ids
    assert torch.equal(got.residual_stream, ours.results.stacked()) and got.residual_stream.shape[0] == 1
    bad = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"model": tiny_model("qwen2"), "prompt": P2, "max_tokens": 1,
                           "vllm_xargs": {"apply_steering_vectors": "[{\"layer_indices\": [1]}]"}})
    assert bad.status_code == 400 and "apply_steering_vectors[0]" in bad.text, bad.text


def test_client_chat_equals_offline(client, refs):
    out = client.chat(CHAT, CASES["capture_all"][1], max_tokens=5, temperature=0)
    tokens, ref = refs["chat"]
    assert out.token_ids == tokens and out.text
    _same(out.results, ref, "Client.chat")


def test_concurrent_requests_stay_isolated(server, refs):
    """Nine requests with different specs at once: each equals its solo offline result."""
    names = list(CASES)

    async def main():
        async with vllm_hook.AsyncClient(server.url, api_key=API_KEY) as ac:
            return await asyncio.gather(*(
                ac.generate(CASES[n][0], CASES[n][1], max_tokens=CASES[n][2], temperature=0)
                for n in names))

    outs = asyncio.run(main())
    assert len(names) == 9
    for name, out in zip(names, outs):
        _check_case(name, out, refs)


@pytest.mark.parametrize("name", ["capture_generated", "capture_last_prompt"])
def test_requests_finishing_together_share_one_fetch(server, client, refs, name):
    """One HTTP request with 32 prompts: vLLM adds them at once, they run in the same engine
    steps and finish together (vLLM schedules the first alone: 2 RPCs measured), and their
    results come in one fetch RPC per step, not 32; each equals its solo offline run.
    A capture of generated tokens is fetched as its finishing step comes back; one complete at
    the prompt (last prompt token) as its first token comes back, while it decodes
    (`FetchBatcher.hold`): nothing is fetched at its finish. (Concurrent clients reach this
    2-core server over 50-150 ms, finish over several steps and share one RPC per step: 3 to
    19 RPCs for 32 in 13 runs.)"""
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    ids, spec, n = CASES[name]
    tokens, ref = refs[name]
    before = client.health()["frontend"]
    resp = oc.completions.create(model=tiny_model("qwen2"), prompt=[ids] * 32, max_tokens=n, temperature=0,
                                 extra_body={"vllm_xargs": {"vllm_hook": json.dumps(spec)}})
    after = client.health()["frontend"]
    fetches = after["fetches"] - before["fetches"]
    held = after["fetched_while_running"] - before["fetched_while_running"]
    at_finish = after["early_fetches"] - before["early_fetches"]
    if name == "capture_last_prompt":
        assert (held, at_finish) == (32, 0)
    else:
        # each sent as its engine step came back, before vLLM processed it (`FetchBatcher.prefetch`)
        assert held == 0 and at_finish == fetches
    got = client.results_of(resp)
    assert len(got) == 32
    for r in got:
        assert r.token_ids == list(ids) + tokens
        _same(r, ref, "32 prompts in one request")
    print(f"\n[served fetch batching] {name}: {fetches} fetch RPCs for 32 requests")
    assert fetches <= 3, f"{fetches} fetch RPCs for 32 requests"


def test_results_complete_at_the_prompt_are_made_while_it_decodes(server, client, refs):
    """A capture of prompt tokens only is fetched as the request's first token comes back
    (`FetchBatcher.hold`), its Results built and, for a client that reads tokenless
    safetensors (the plugin's clients), its entry data made then too (`encode.Ready`): the
    entry is marked "tokens": "choice" and reads back equal to the offline run; another
    client gets full safetensors of the same Results."""
    for name in ("capture_last_prompt", "capture_positions"):
        ids, spec, n = CASES[name]
        tokens, ref = refs[name]
        before = client.health()["frontend"]
        out = client.generate(ids, spec, max_tokens=n, temperature=0)
        after = client.health()["frontend"]
        assert after["fetched_while_running"] - before["fetched_while_running"] == 1
        assert after["delivered_built_ahead"] - before["delivered_built_ahead"] == 1
        assert after["early_fetches"] == before["early_fetches"]          # none at the finish
        (entry,) = out.raw["vllm_hook"]["results"]
        assert entry["format"] == "safetensors" and entry["tokens"] == "choice"
        _check_case(name, out, refs)
        body = {"model": tiny_model("qwen2"), "prompt": ids, "max_tokens": n, "temperature": 0,
                "vllm_xargs": {"vllm_hook": json.dumps(spec)}}
        (e,) = httpx.post(f"{server.url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}).json()["vllm_hook"]["results"]
        assert "tokens" not in e
        _same(vllm_hook.Results.from_bytes(base64.b64decode(e["data"])), ref, name)


def _settled(client) -> dict:
    """Health once nothing is pending or held in the API server and nothing is admitted or
    waiting on the workers (an aborted request's cleanup is asynchronous)."""
    deadline = time.monotonic() + 60
    while True:
        h = client.health()
        w = h["workers"][0]
        if (h["pending_requests"], h["held_results"], w["admitted"], w["results_waiting"]) == (0, 0, 0, 0):
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.2)


def test_a_request_aborted_after_its_early_fetch_leaves_nothing(server, client):
    """A capture of the last prompt token whose client goes away while it decodes (a client
    timeout; 490 tokens): its results were fetched as its first token came back
    (`FetchBatcher.hold`); the abort drops them in the API server, and nothing is left there
    or on the workers. Shorter timeouts are tried where this vLLM decodes the 490 tokens
    before the first one (0.30 and 0.31 on this CPU: within 0.3 s); whatever happens,
    nothing is left."""
    ids, spec, _ = CASES["capture_last_prompt"]
    body = {"model": tiny_model("qwen2"), "prompt": ids, "max_tokens": 490, "temperature": 0,
            "ignore_eos": True, "vllm_xargs": {"vllm_hook": json.dumps(spec)}}
    shown = False
    for timeout in (0.3, 0.2, 0.15, 0.1, 0.07, 0.05, 0.035, 0.025, 0.018, 0.012):
        before = client.health()["frontend"]
        try:
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout,
                       headers={"Authorization": f"Bearer {API_KEY}"})
            aborted = False
        except httpx.TimeoutException:
            aborted = True
        h = _settled(client)
        held = h["frontend"]["fetched_while_running"] - before["fetched_while_running"]
        delivered = h["frontend"]["delivered_built_ahead"] - before["delivered_built_ahead"]
        assert held <= 1 and delivered <= held
        if aborted and held == 1 and delivered == 0:
            shown = True            # fetched while decoding, then aborted: dropped
            break
    _good_request_works(client)
    if not shown:
        pytest.skip("this vLLM finished the request before any client timeout tried, or before "
                    "its first token: the abort after an early fetch was not reached")


def test_steering_only_requests_need_no_fetch(server, client, refs):
    """Served steering-only requests whose workers marked them clean (`delivery.arena`) come
    back with no fetch RPC, steered as the same steering with a capture beside it."""
    ids, spec, n = CASES["steer_add"]
    tokens, _ = refs["steer_add"]
    client.generate(*CASES["capture_last_prompt"][:2], max_tokens=1)    # a fetch maps the arena
    before = client.health()["frontend"]
    outs = [client.generate(ids, {"steer": spec["steer"]}, max_tokens=n, temperature=0) for _ in range(3)]
    after = client.health()["frontend"]
    for out in outs:
        assert out.token_ids == tokens and out.results.ok and out.results.token_ids == ids + tokens
    assert after["fetches"] == before["fetches"]
    assert after["delivered_without_fetch"] == before["delivered_without_fetch"] + 3
    # Nothing but tokens, which the choice carries (the clients ask for token ids, and say
    # they read such entries): no safetensors, and the client builds the same Results.
    entry = outs[0].raw["vllm_hook"]["results"][0]
    assert entry["format"] == "tokens" and entry["data"] is None and entry["errors"] == []
    r = outs[0].results
    assert r.prompt_len == len(ids) and r.request_id and r.model and r.index == 0 and not r.activations
    steer = json.dumps({"steer": spec["steer"]})
    head = {"Authorization": f"Bearer {API_KEY}"}
    # Another client (an older one, or by hand) gets safetensors, token ids asked for or not.
    for extra in ({}, {"return_token_ids": True}):
        body = {"model": tiny_model("qwen2"), "prompt": ids, "max_tokens": n, "temperature": 0,
                "vllm_xargs": {"vllm_hook": steer}, **extra}
        (e,) = httpx.post(f"{server.url}/v1/completions", json=body, headers=head).json()["vllm_hook"]["results"]
        assert e["format"] == "safetensors" and e["data"]
        assert vllm_hook.Results.from_bytes(base64.b64decode(e["data"])).token_ids == ids + tokens
    # Several prompts with n = 2: each entry names its choice, its meta the child; a stream
    # stays safetensors (its results event stands alone).
    body = {"model": tiny_model("qwen2"), "prompt": [ids, P3], "n": 2, "max_tokens": 3, "temperature": 1.0,
            "seed": 5, "vllm_xargs": {"vllm_hook": steer}, "return_token_ids": True}
    raw = httpx.post(f"{server.url}/v1/completions", json=body, headers={**head, "x-vllm-hook-accept": "tokens"}).json()
    got = shown_tokens(raw)
    assert [e["format"] for e in raw["vllm_hook"]["results"]] == ["tokens"] * 4
    for i, res_ in enumerate(client.results_of(raw)):
        prompt, gen = got[i]
        assert res_.ok and res_.token_ids == prompt + gen and res_.index == i % 2 and prompt == (ids, P3)[i // 2]
    events = [json.loads(line[5:]) for line in httpx.post(
        f"{server.url}/v1/completions", json={**body, "stream": True},
        headers={**head, "x-vllm-hook-accept": "tokens"}).text.splitlines()
        if line.startswith("data:") and "[DONE]" not in line]
    hook = [ev for ev in events if ev.get("object") == "vllm_hook.results"][0]
    assert {e["format"] for e in hook["vllm_hook"]["results"]} == {"safetensors"}
    # openai objects, chat (whose prompt ids are the response's, not the choice's)
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    resp = oc.chat.completions.create(
        model=tiny_model("qwen2"), messages=CHAT, max_tokens=3, temperature=0,
        extra_headers={"x-vllm-hook-accept": "tokens"},
        extra_body={"vllm_xargs": {"vllm_hook": steer}, "return_token_ids": True})
    (got,) = client.results_of(resp)
    assert resp.model_extra["vllm_hook"]["results"][0]["format"] == "tokens"
    assert got.ok and got.token_ids == resp.prompt_token_ids + resp.choices[0].token_ids


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streamed_request_gets_results(server, refs, route):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    extra = {"vllm_xargs": {"vllm_hook": json.dumps(CASES["capture_all"][1])}, "return_token_ids": True}
    if route == "completions":
        ids, _, n = CASES["capture_all"]
        stream = oc.completions.create(model=tiny_model("qwen2"), prompt=ids, max_tokens=n,
                                       temperature=0, stream=True, extra_body=extra)
        ref_name = "capture_all"
    else:
        stream = oc.chat.completions.create(model=tiny_model("qwen2"), messages=CHAT, max_tokens=5,
                                            temperature=0, stream=True, extra_body=extra)
        ref_name = "chat"
    chunks = list(stream)
    hook = [c for c in chunks if c.object == "vllm_hook.results"]
    assert len(hook) == 1 and chunks[-1] is hook[0], "one results event, just before [DONE]"
    tokens = [t for c in chunks for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
    with vllm_hook.Client(server.url, api_key=API_KEY) as c:
        (got,) = c.results_of(hook[0])
    ref_tokens, ref = refs[ref_name]
    assert tokens == ref_tokens
    _same(got, ref, f"streamed {route}")


def test_n_greater_than_one_gives_one_result_per_choice(client):
    ids, spec, _ = CASES["capture_last_prompt"]
    out = client.generate([ids, P3], spec, max_tokens=3, temperature=1.0, n=2, seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        prompt = ids if c.index < 2 else P3
        assert c.results.token_ids == prompt + c.token_ids
        assert c.results.activations["resid_post"][1].shape == (1, H)


# ---- errors ---------------------------------------------------------------------------------

GOOD = [0.1] * H
BAD_SPECS = {
    "unknown_field": ({"capture": [], "stear": []}, 400, "unknown field 'stear'"),
    "malformed_json": ('{"capture": [', 400, "malformed JSON"),
    "wrong_vector_size": ({"steer": [{"op": "add", "layer": 0, "vector": [1.0] * 12}]}, 400,
                          "expected 128 values"),
    "nan_vector": ({"steer": [{"op": "add", "layer": 0, "vector": [math.nan] * H}]}, 400, "NaN"),
    "bad_layer": ({"capture": [{"layers": [4]}]}, 400, "out of range for a 4-layer model"),
    "bad_position": ({"capture": [{"tokens": [-1000]}]}, 400, "before the start"),
    "save_on_server": ({"save": {"dir": "/tmp/x"}, "capture": [{"layers": [0]}]}, 400,
                       "not available over HTTP"),
    "unknown_vector": ({"steer": [{"op": "add", "layer": 0, "vector": "no_such"}]}, 404,
                       "no registered vector named 'no_such'"),
    # Hostile values that used to reach the workers or give HTTP 500 (reliability issue).
    "nested_json": ("[" * 10000 + "]" * 10000, 400, "nested too deeply"),
    "position_1e30": ({"steer": [{"op": "add", "layer": 0, "vector": GOOD, "tokens": [1e30]}]}, 400,
                      "expected an integer"),
    "position_2_pow_63": ({"steer": [{"op": "add", "layer": 0, "vector": GOOD, "tokens": [2 ** 63]}]}, 400,
                          "max_model_len"),
    "layer_true": ({"capture": [{"layers": [True]}]}, 400, "expected an integer"),
    "overflowing_scale": ({"steer": [{"op": "add", "layer": 0, "vector": GOOD, "scale": 1e39}]}, 400,
                          "exceeds"),
    # A lone surrogate in the spec text (a JSON "\ud800" escape in the request body)
    "lone_surrogate": ('{"steer": [{"op": "add", "layer": 0, "vector": "\ud800"}]}', 404,
                       "no registered vector named"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_spec_status(server, client, case, route, stream):
    spec, status, needle = BAD_SPECS[case]
    raw = spec if isinstance(spec, str) else json.dumps(spec)
    body = {"model": tiny_model("qwen2"), "max_tokens": 2, "stream": stream,
            "vllm_xargs": {"vllm_hook": raw}}
    body.update({"prompt": P2} if route == "completions" else {"messages": CHAT})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    # json.dumps escapes non-ASCII (a lone surrogate too), as JSON clients send it
    r = httpx.post(server.url + path, content=json.dumps(body), timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "Fix:" in err["message"] and err["code"] == status
    _good_request_works(client)


def test_bad_input_corpus_over_http(server, client, refs):
    """Every input of tests/reliability/corpus.py gets its 4xx with a message naming the field
    and the fix, on one keep-alive connection, each followed by a valid request on it; then a
    request still equals its offline result."""
    from collections import Counter

    from tests.reliability import corpus

    auth = {"Authorization": f"Bearer {API_KEY}"}
    ids, spec, n = CASES["capture_last_prompt"]
    good = {"model": tiny_model("qwen2"), "prompt": ids, "max_tokens": n, "temperature": 0,
            "vllm_xargs": {"vllm_hook": json.dumps(spec)}}
    statuses, wrong = Counter(), []

    def check(name, r, status, words, fix):
        statuses[r.status_code] += 1
        try:
            body = r.json()
            err = body.get("error", body) if isinstance(body, dict) else body
            msg = str(err.get("message") or err.get("detail") or err) if isinstance(err, dict) else str(err)
        except ValueError:
            msg = r.text
        missing = [w for w in words + (["Fix:"] if fix else []) if w not in msg]
        if r.status_code != status or missing:
            wrong.append(f"{name}: HTTP {r.status_code} (want {status}), missing {missing}: {msg[:300]}")

    with httpx.Client(base_url=server.url, timeout=120) as http:      # headers per request
        def after(name):
            r = http.post("/v1/completions", json=good, headers=auth)
            if r.status_code != 200:
                wrong.append(f"{name}: the next valid request got HTTP {r.status_code}")

        for name, (spec_, status, words) in corpus.SPECS.items():
            raw = spec_ if isinstance(spec_, str) else json.dumps(spec_)
            body = {**good, "max_tokens": corpus.BIG_MAX_TOKENS.get(name, 2), "vllm_xargs": {"vllm_hook": raw}}
            status = corpus.HTTP_STATUS.get(name, (status, words))[0]
            words = corpus.HTTP_STATUS.get(name, (status, words))[1]
            check(name, http.post("/v1/completions", json=body, headers=auth), status, words,
                  fix=name not in corpus.HTTP_STATUS)
            after(name)
        for name, (vbody, status, words) in corpus.VECTORS.items():
            r = http.post("/v1/hook/vectors", content=json.dumps(vbody).encode(),   # NaN as JSON's NaN
                          headers={**auth, "content-type": "application/json"})
            check(name, r, status, words, fix=False)
            after(name)
        for name, (method, path, kw, status, words) in corpus.HTTP.items():
            kw = dict(kw)
            headers = dict(auth)
            a = kw.pop("auth", True)
            if a is False:
                headers.pop("Authorization")
            elif isinstance(a, str):
                headers["Authorization"] = f"Bearer {a}"
            if kw.pop("json_type", False):
                headers["content-type"] = "application/json"
            if "xargs" in kw:
                kw["json"] = {**good, "vllm_xargs": kw.pop("xargs")}
            r = http.request(method, path, headers=headers, **kw)
            check(name, r, status, words, fix=False)
            after(name)
    print(f"\n[corpus over HTTP] {corpus.counts()}; statuses {dict(sorted(statuses.items()))}")
    assert not wrong, "\n".join(wrong)
    assert all(400 <= s < 500 for s in statuses)

    async def neighbours():
        """Every bad spec at once, beside good requests: the good ones equal their solo runs."""
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=300) as ah, \
                vllm_hook.AsyncClient(server.url, api_key=API_KEY) as ac:
            bad = [ah.post("/v1/completions", json={
                **good, "max_tokens": corpus.BIG_MAX_TOKENS.get(name, 2),
                "vllm_xargs": {"vllm_hook": s_ if isinstance(s_, str) else json.dumps(s_)}})
                for name, (s_, _, _) in corpus.SPECS.items() if name not in corpus.HTTP_STATUS]
            goods = [ac.generate(CASES[c][0], CASES[c][1], max_tokens=CASES[c][2], temperature=0)
                     for c in ("capture_all", "steer_norm_match", "capture_last_prompt") * 3]
            got = await asyncio.gather(*bad, *goods)
            return got[:len(bad)], got[len(bad):]

    bad, goods = asyncio.run(neighbours())
    assert [r.status_code for r in bad if not 400 <= r.status_code < 500] == []
    for c, out in zip(("capture_all", "steer_norm_match", "capture_last_prompt") * 3, goods):
        _check_case(c, out, refs)
    _check_case("capture_last_prompt", client.generate(ids, spec, max_tokens=n, temperature=0), refs)
    assert client.health()["pending_requests"] == 0


def test_hostile_inputs_keep_the_connection(server):
    """One keep-alive connection: every hostile request gets a 4xx and the next, valid one on
    the same connection is served (a 500 used to close it)."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    good = {"model": tiny_model("qwen2"), "prompt": P2, "max_tokens": 1,
            "vllm_xargs": {"vllm_hook": json.dumps({"capture": [{"layers": [0], "tokens": "last_prompt"}]})}}
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as http:
        for case in ("nested_json", "position_1e30", "position_2_pow_63", "overflowing_scale"):
            spec = BAD_SPECS[case][0]
            raw = spec if isinstance(spec, str) else json.dumps(spec)
            r = http.post("/v1/completions", json={**good, "vllm_xargs": {"vllm_hook": raw}})
            assert r.status_code == 400, (case, r.text)
            assert http.post("/v1/completions", json=good).status_code == 200, case
        nested = b'{"v": ' + b"[" * 10000 + b"]" * 10000 + b"}"
        r = http.post("/v1/hook/vectors", content=nested, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.text, r.text
        r = http.post("/v1/hook/vectors", json={"v": [[[1.0]]]})
        assert r.status_code == 400, r.text
        assert http.post("/v1/completions", json=good).status_code == 200
        assert http.get("/v1/hook/health").json()["pending_requests"] == 0


@pytest.mark.parametrize("case", ["bad_layer", "unknown_vector"])
def test_other_endpoints_refuse_bad_specs_too(server, client, case):
    """/v1/responses returns no results, but a bad spec still gets 400/404, never 500."""
    spec, status, needle = BAD_SPECS[case]
    body = {"model": tiny_model("qwen2"), "input": "Hello", "max_output_tokens": 2,
            "vllm_xargs": {"vllm_hook": json.dumps(spec)}}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == status and needle in r.text, r.text
    _good_request_works(client)


def test_client_raises_spec_errors(client):
    with pytest.raises(vllm_hook.UnknownVectorError):
        client.generate(P2, {"steer": [{"op": "add", "layer": 0, "vector": "no_such"}]}, max_tokens=1)
    with pytest.raises(vllm_hook.SpecError) as e:
        client.generate(P2, {"capture": [{"layers": [9]}]}, max_tokens=1)
    assert e.value.status == 400


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/hook/vectors"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_oversize_body_is_413(server, client, path, chunked):
    spec = {"steer": [{"op": "add", "layer": 0, "vector": [0.125] * 150_000}]}
    body = json.dumps({"model": tiny_model("qwen2"), "prompt": P2, "messages": CHAT, "max_tokens": 1,
                       "vllm_xargs": {"vllm_hook": json.dumps(spec)}}).encode()
    assert len(body) > MAX_BODY
    content = (body[i:i + 65536] for i in range(0, len(body), 65536)) if chunked else body
    r = httpx.post(server.url + path, content=content, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert "max_request_bytes" in r.json()["error"]["message"]
    _good_request_works(client)


# ---- routes ---------------------------------------------------------------------------------

def test_vector_routes(server, client):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert "calm" in client.list_vectors()
    names = client.register_vectors({"tmp.a": vec(20), "tmp-b": {"b64": vllm_hook.encode_vector(
        vec(21), "bfloat16")["b64"], "dtype": "bfloat16"}})
    assert {"calm", "tmp.a", "tmp-b"} <= set(names)
    out = client.generate(P3, {"steer": [{"op": "add", "layer": 1, "vector": "tmp.a", "scale": 5.0}]},
                          max_tokens=3, temperature=0)
    assert out.results.ok
    assert set(client.delete_vectors(["tmp.a", "tmp-b"])) == {"calm"}
    url = f"{server.url}/v1/hook/vectors"
    assert httpx.delete(f"{url}/tmp.a", headers=auth).status_code == 404
    bad = httpx.post(url, json={"short": [1.0, 2.0]}, headers=auth)
    assert bad.status_code == 400 and "expected 128 values" in bad.text
    bad = httpx.post(url, content=b"{not json", headers={**auth, "content-type": "application/json"})
    assert bad.status_code == 400
    bad = httpx.post(url, json={"bad name!": GOOD}, headers=auth)
    assert bad.status_code == 400 and "invalid vector name" in bad.text
    with pytest.raises(vllm_hook.UnknownVectorError):
        client.generate(P3, {"steer": [{"op": "add", "layer": 1, "vector": "tmp.a"}]}, max_tokens=1)


def test_routes_require_the_api_key(server):
    for method, path in [("GET", "/v1/hook/health"), ("GET", "/v1/hook/vectors"),
                         ("POST", "/v1/hook/vectors"), ("DELETE", "/v1/hook/vectors/calm"),
                         ("GET", "/v1/hook/results/x"), ("DELETE", "/v1/hook/results/x")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, server.url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, r.status_code)


def test_health(client):
    h = client.health()
    assert h["status"] == "ok" and h["vllm_hook_version"] == vllm_hook.__version__
    assert h["vllm_version"] and h["num_layers"] == 4 and h["hidden_size"] == H
    assert h["limits"] == {"max_inline_result_bytes": INLINE, "max_request_bytes": MAX_BODY}
    assert {"count", "bytes", "max_bytes", "ttl_s"} <= set(h["retained_results"])
    assert len(h["workers"]) == 1 and "retained_bytes" in h["workers"][0]


# ---- memory -----------------------------------------------------------------------------------

def test_500_requests_leave_nothing_retained(server, client):
    """Half the results go by handle (fetched, then deleted by the client), half inline."""
    big = {"capture": [{"layers": [0, 1], "tokens": "all"}]}       # > INLINE bytes
    small = {"capture": [{"layers": [2], "tokens": "last_prompt"}]}
    prompts = [[(i * 7 + j) % 500 + 3 for j in range(10)] for i in range(500)]

    async def main():
        sem = asyncio.Semaphore(64)
        async with vllm_hook.AsyncClient(server.url, api_key=API_KEY) as ac:
            async def one(i):
                async with sem:
                    return await ac.generate(prompts[i], big if i % 2 else small, max_tokens=1,
                                             temperature=0)
            return await asyncio.gather(*(one(i) for i in range(500)))

    t0 = time.monotonic()
    outs = asyncio.run(main())
    elapsed = time.monotonic() - t0
    handles = sum(o.raw["vllm_hook"]["results"][0]["handle"] is not None for o in outs)
    assert handles == 250
    for i, o in enumerate(outs):
        r = o.results
        assert r.ok and r.token_ids[:10] == prompts[i]
        assert r.activations["resid_post"][(1 if i % 2 else 2)].shape[0] == (10 if i % 2 else 1)
    h = client.health()
    assert h["retained_results"]["count"] == 0 and h["retained_results"]["bytes"] == 0, h
    assert h["pending_requests"] == 0
    w = h["workers"][0]
    assert w["retained_bytes"] == 0 and w["results_waiting"] == 0 and w["admitted"] == 0, w
    left = [f for f in glob.glob("/dev/shm/vllm_hook-*") if "-probe-" not in f and "-free-" not in f]
    assert not left, f"spilled result files left behind: {left[:3]}"
    free = sum(os.path.getsize(f) for f in glob.glob("/dev/shm/vllm_hook-free-*"))
    assert free <= KEEP_FREE_BYTES, f"{free} bytes of free spill files kept"      # kept for reuse
    print(f"500 requests in {elapsed:.1f} s")


# ---- pieces that need no server ---------------------------------------------------------------

def test_result_store_bounds():
    now = [0.0]
    store = ResultStore(max_bytes=100, ttl_s=10.0, clock=lambda: now[0])
    a = store.put(b"a" * 40)
    b = store.put(b"b" * 40)
    assert store.stats().bytes == 80
    c = store.put(b"c" * 40)             # over the bound: the oldest goes
    assert store.get(a) is None and store.get(b) and store.get(c)
    assert store.put(b"x" * 101) is None  # never fits
    now[0] = 11.0                         # past the TTL: everything goes
    assert store.get(b) is None and store.stats().count == 0 and store.stats().bytes == 0
    d = store.put(b"d")
    assert store.delete(d) and not store.delete(d) and store.stats().bytes == 0


def test_routes_attach_once():
    from argparse import Namespace

    from fastapi import FastAPI

    from vllm_hook.server.plugin import make_plugin
    from vllm_hook.server.routes import attach

    app = FastAPI()
    app.state.args = Namespace(additional_config={"vllm_hook": HOOK_CONFIG})
    attach(app)                          # what the general plugin does
    plugin = make_plugin()               # what VLLM_PLUGINS=...,vllm_hook_routes adds
    assert plugin.name == "vllm_hook_routes"
    plugin.attach_router(app)
    hook_routes = [r for r in app.routes if getattr(r, "path", "").startswith("/v1/hook/")]
    assert len(hook_routes) == 12          # 7 for vectors, results, health; 5 for hooks
    assert sum(m.cls.__name__ == "BodyLimit" for m in app.user_middleware) == 1


def test_results_bytes_round_trip(tmp_path):
    r = vllm_hook.Results(request_id="r", prompt_len=2, token_ids=[1, 2, 3],
                          activations={"resid_post": {1: torch.randn(2, 4)}},
                          positions={"resid_post": {1: torch.tensor([0, 2])}}, errors=["e"],
                          hook_results=[{"x": [torch.arange(3), torch.ones(2, 2)], "n": 2.5, "s": "a"}, {}])
    back = vllm_hook.Results.from_bytes(r.to_bytes())
    assert back.token_ids == [1, 2, 3] and back.errors == ["e"] and back.prompt_len == 2
    assert torch.equal(back.hook_results[0]["x"][1], torch.ones(2, 2)) and back.hook_results[1] == {}
    assert back.hook_results[0]["n"] == 2.5 and back.hook_results[0]["s"] == "a"
    assert torch.equal(back.activations["resid_post"][1], r.activations["resid_post"][1])
    r.save(tmp_path / "r.safetensors")     # the same format as a file
    loaded = vllm_hook.Results.from_bytes((tmp_path / "r.safetensors").read_bytes())
    assert loaded.token_ids == back.token_ids and loaded.errors == back.errors
    assert torch.equal(loaded.activations["resid_post"][1], back.activations["resid_post"][1])


# ---- Python hooks over HTTP -----------------------------------------------------------------

def _hook_spec(*hooks, capture=None) -> str:
    return json.dumps({"hooks": list(hooks), **({"capture": capture} if capture else {})})


def test_named_operator_hook_with_the_openai_client(server, client):
    import openai

    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    spec = _hook_spec({"name": "stream_norms", "args": {"layers": [1, 2]}},
                      {"name": "scale_stream", "args": {"layers": [2], "factor": 1.5}},
                      capture=[{"layers": [1, 2]}])
    resp = oa.completions.create(model=tiny_model("qwen2"), prompt=P1, max_tokens=4, temperature=0,
                                 extra_body={"vllm_xargs": {"vllm_hook": spec}})
    r = client.results_of(resp)[0]
    assert r.ok, r.errors
    norms = r.hook_results[0]
    assert torch.allclose(torch.cat(norms["layer1"]), r.activations["resid_post"][1].norm(dim=-1), rtol=1e-5)
    plain = client.generate(P1, {"capture": [{"layers": [2]}]}, max_tokens=1, temperature=0).results
    P = len(P1)
    # Hooks run before captures: the stream after layer 2 is the scaled one.
    assert rel_err(r.activations["resid_post"][2][:P], 1.5 * plain.activations["resid_post"][2][:P]) <= 1e-6
    assert r.hook_results[1] == {}
    health = client.health()["hooks"]
    assert {"logit_lens", "scale_stream", "raise_after"} <= set(health["operator_hooks"])
    assert health["allow_client_code"] is False and health["layers"] == [0, 1, 2, 3]


def test_pickled_hook_is_refused_without_allow_client_code(server, client):
    hook = vllm_hook.Hook(lambda ctx, h: None, [1])
    for spec in ({"hooks": [hook]}, {"hooks": [{"pickle": "AAAA"}]}):
        with pytest.raises(vllm_hook.SpecError) as e:
            client.generate(P2, spec, max_tokens=1)
        assert e.value.status == 400 and "allow_client_code" in str(e.value), str(e.value)
    r = httpx.post(f"{server.url}/v1/hook/hooks/register", json={"hooks": [{"pickle": "AAAA"}]},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and "allow_client_code" in r.text
    _good_request_works(client)


def test_a_raising_hook_fails_only_its_request(server):
    async def both():
        async with vllm_hook.AsyncClient(server.url, api_key=API_KEY) as ac:
            bad = ac.generate(P3, {"hooks": [{"name": "raise_after", "args": {"layers": [1], "calls": 2}}]},
                              max_tokens=5, temperature=0)
            good = ac.generate(P1, {"capture": [{"layers": [1]}],
                                    "hooks": [{"name": "stream_norms", "args": {"layers": [1]}}]},
                               max_tokens=5, temperature=0)
            return await asyncio.gather(bad, good)

    bad, good = asyncio.run(both())
    assert len(bad.token_ids) == 5 and not bad.results.ok
    assert any("raise_after" in e and "raised ValueError: deliberate failure on call 2" in e
               for e in bad.results.errors), bad.results.errors
    assert good.results.ok and len(good.results.hook_results[0]["layer1"]) == 5


def test_persistent_hooks_over_http(server, client):
    try:
        assert client.register_hooks([{"name": "stream_norms", "args": {"layers": [0]}}]) == 1
        client.clear_hook_results()
        outs = [client.generate(P, None, max_tokens=3, temperature=0) for P in (P1, P2, P3)]
        got = client.collect_hook_results()
        assert len(got) >= 3
        rows = sorted(len(torch.cat(entry[0]["layer0"])) for entry in got.values())
        assert sorted(len(o.prompt_token_ids) + 2 for o in outs) == rows[-3:] or len(rows) >= 3
        assert client.health()["hooks"]["persistent"] == 1
        assert client.clear_hook_results() >= 3 and client.collect_hook_results() == {}
    finally:
        client.clear_hooks()
    assert client.health()["hooks"]["persistent"] == 0
    r = httpx.post(f"{server.url}/v1/hook/hooks/register", json={"hooks": [{"name": "nope"}]},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and "no operator hook named 'nope'" in r.text
    assert client.prefetch_params(["lm_head.weight"]) == ["lm_head.weight"]


# ---- vllm-hook extract --server -----------------------------------------------------------

def test_extract_over_http_equals_client_results(server, client, tmp_path):
    import subprocess
    import sys

    from tests.helpers.common import random_prompts, write_jsonl
    from vllm_hook.extract import Job, ServedEngine, extract

    texts = random_prompts(24, seed=11)
    inputs = [{"prompt": t} for t in texts] + ["{bad"] + [{"messages": CHAT}]
    src = write_jsonl(tmp_path / "in.jsonl", inputs)
    eng = ServedEngine(server.url, api_key=API_KEY, concurrency=8)
    try:
        job = Job(model=eng.model, input=str(src), layers=[0, 3], tokens="all", shard_rows=200)
        m = extract(eng, job, tmp_path / "api", progress=False)
    finally:
        eng.close()
    assert m.complete and [f.where for f in m.failures] == ["line 25"]
    ds = vllm_hook.load_dataset(tmp_path / "api")
    idx = ds["prompt_index"]
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            assert not (idx == i).any()
            continue
        gen = (client.generate(x["prompt"], job.spec(), max_tokens=1, temperature=0) if "prompt" in x
               else client.chat(x["messages"], job.spec(), max_tokens=1, temperature=0))
        r, rows = gen.results, idx == i
        assert torch.equal(ds["position"][rows], r.positions["resid_post"][0])
        assert ds["token_id"][rows].tolist() == [r.token_ids[p] for p in r.positions["resid_post"][0]]
        for L in (0, 3):
            assert rel_err(ds.activations(L)[rows], r.activations["resid_post"][L]) <= TOL, (i, L)

    # The command line does the same job.
    cli = subprocess.run([sys.executable, "-m", "vllm_hook.extract", str(src), "--server", server.url,
                          "--api-key", API_KEY, "--layers", "0,3", "--shard-rows", "200",
                          "--out", str(tmp_path / "cli"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "line 25: not valid JSON" in cli.stderr
    other = vllm_hook.load_dataset(tmp_path / "cli")
    assert other.manifest.shards == ds.manifest.shards
    for col in ds.columns:
        assert rel_err(other[col].float(), ds[col].float()) <= TOL, col


def test_steering_sessions_over_the_server(server, client):
    """SteerModel / AsyncSteerModel over Client / AsyncClient: the session's steering equals
    the same spec sent by hand; chat builds the prompt here and keeps message boundaries."""
    model = vllm_hook.SteerModel(client, tokenizer=tiny_model("qwen2"))
    assert (model.hidden_size, model.layer_count) == (H, 4)
    model.set_layer_vector(1, vec(61), scale=3.0)
    kw = dict(max_tokens=5, temperature=0.0, ignore_eos=True)
    got = model.generate([P1, P2], capture_layers=[1, 3], **kw)
    for g, ids in zip(got, (P1, P2)):
        ref = client.generate(ids, spec={"steer": [_steer("add", 1, 61, scale=3.0)],
                                         "capture": [{"layers": [1, 3], "tokens": "all"}]}, **kw)
        assert g.token_ids == ref.token_ids and g.prompt_token_ids == ids
        for L in (1, 3):
            assert torch.equal(g.activations(L), ref.results.activations["resid_post"][L])
    (c,) = model.chat(CHAT, capture_layers=[2], **kw)
    b = c.message_boundaries
    assert b[0].start == 0 and b[-1].end == len(c.prompt_token_ids)
    assert all(x.end == y.start for x, y in zip(b, b[1:]))
    assert c.activations(2).shape[0] == len(c.prompt_token_ids) + 4
    model.clear_all_vectors()
    assert model.generate(P1, **kw)[0].token_ids == client.generate(P1, **kw).token_ids

    async def go():
        async with vllm_hook.AsyncClient(server.url, api_key=API_KEY) as ac:
            h = await ac.health()
            am = vllm_hook.AsyncSteerModel(ac, dims=(h["hidden_size"], h["num_layers"]))
            am.set_layer_vector(1, vec(61), scale=3.0)
            return await am.generate([P1], **kw)
    assert asyncio.run(go())[0].token_ids == got[0].token_ids


def test_inspect_eval_through_the_provider(server, client, tmp_path):
    """A real Inspect eval (3 samples, local) through `vllm-hook/<model>` against the server:
    the spec rides in extra_body, each output's metadata holds its activations, equal to the
    same chat request sent by hand."""
    pytest.importorskip("inspect_ai")
    from inspect_ai import Task, eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import Score, accuracy, scorer
    from inspect_ai.solver import generate

    from vllm_hook.inspect_provider import extra_body

    seen: dict[str, dict] = {}

    @scorer(metrics=[accuracy()])
    def has_activations():
        async def score(state, target):
            seen[state.input_text] = state.output.metadata or {}
            return Score(value=1.0 if "activations" in (state.output.metadata or {}) else 0.0)
        return score

    words = ("sea", "sky", "sun")
    task = Task(dataset=[Sample(input=f"Please write a short poem about the {w}", target=w) for w in words],
                solver=generate(), scorer=has_activations())
    spec = {"capture": [{"layers": [1, 3], "tokens": "last_prompt"}],
            "steer": [{"op": "add", "layer": 1, "vector": vec(71), "scale": 2.0}]}     # a tensor: base64
    (log,) = inspect_eval(task, model=f"vllm-hook/{tiny_model('qwen2')}", model_base_url=f"{server.url}/v1",
                          model_args={"api_key": API_KEY}, extra_body=extra_body(spec), max_tokens=4,
                          temperature=0.0, log_dir=str(tmp_path), display="none")
    assert log.status == "success", log.error
    assert log.results.scores[0].metrics["accuracy"].value == 1.0 and len(seen) == 3
    for w in words:
        text = f"Please write a short poem about the {w}"
        md = seen[text]
        ref = client.chat([{"role": "user", "content": text}], spec=spec, max_tokens=4, temperature=0.0)
        assert md["vllm_hook_errors"] == []
        for L in (1, 3):
            assert torch.equal(md["activations"]["resid_post"][L], ref.results.activations["resid_post"][L])


def test_clients_stream(server, client):
    """Client.stream / stream_chat and AsyncClient's: the deltas add up to the non-streamed
    text, the results equal the non-streamed ones; a bad spec raises when iterated."""
    spec = {"steer": [_steer("add", 1, 1, scale=4.0)], "capture": [{"layers": [1, 2]}]}
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = client.generate(P2, spec, **kw)
    s = client.stream(P2, spec, **kw)
    deltas = list(s)
    assert len(deltas) > 1 and "".join(deltas) == s.text == ref.text
    _same(s.results, ref.results, "stream")
    c = client.stream_chat(CHAT, spec, **kw)
    assert "".join(c) == client.chat(CHAT, spec, **kw).text and c.results is not None
    with pytest.raises(vllm_hook.SpecError, match="layer 9"):
        list(client.stream(P2, {"capture": [{"layers": [9]}]}, **kw))

    async def go():
        async with vllm_hook.AsyncClient(server.url, api_key=API_KEY) as ac:
            a = ac.stream(P2, spec, **kw)
            got = [d async for d in a]
            return got, a
    got, a = asyncio.run(go())
    assert "".join(got) == ref.text
    _same(a.results, ref.results, "async stream")
