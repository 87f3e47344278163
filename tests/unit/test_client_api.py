"""The two clients offer the same methods, and docs/serve.md lists them all."""

import inspect
import re
from pathlib import Path

import pytest

import vllm_hook


def _public(cls) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")} - {"close", "aclose"}


def test_sync_and_async_clients_have_the_same_methods_as_documented():
    sync, asyn = _public(vllm_hook.Client), _public(vllm_hook.AsyncClient)
    assert sync == asyn
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text()
    listed = set(re.findall(r"`(\w+)`", doc[doc.index("Methods: "):].split("\n\n")[0]))
    assert listed == sync, (sorted(sync - listed), sorted(listed - sync))


def test_request_json_means_what_json_dumps_meant():
    """The clients write request bodies and specs with msgspec; the server reads the same
    values json.dumps gave, NaN included (msgspec writes null for it)."""
    import json
    import math

    import torch

    from vllm_hook.client import _json_bytes, spec_json

    spec = {"steer": [{"op": "add", "layer": i, "vector": "v", "scale": 0.1 * i} for i in range(4)],
            "capture": [{"layers": [1, -1], "tokens": "last_prompt", "site": "résidu"}]}
    assert json.loads(spec_json(spec)) == spec
    body = {"prompt": [1, 2, 3], "temperature": 0.7, "vllm_xargs": {"vllm_hook": spec_json(spec)}}
    assert json.loads(_json_bytes(body)) == body
    nan = json.loads(spec_json({"steer": [{"op": "add", "layer": 0, "vector": "v", "scale": float("nan")}]}))
    assert math.isnan(nan["steer"][0]["scale"])           # not null: the server names the NaN
    assert json.loads(_json_bytes({"a": None, "b": [None]})) == {"a": None, "b": [None]}
    t = json.loads(spec_json({"steer": [{"op": "add", "layer": 0, "vector": torch.ones(3)}]}))
    assert t["steer"][0]["vector"]["b64"]
    from vllm_hook.client import _body

    with pytest.raises(ValueError):                       # refused in a body, as httpx's json= did
        _json_bytes({"prompt": [1], "temperature": float("nan")})
    with pytest.raises(TypeError, match="not bytes"):
        _body({"model": "m", "prompt": b"hi"}, None, {})


def test_the_server_reads_the_accept_header_from_the_asgi_scope():
    """`x-vllm-hook-accept: tokens, stacked, tokenless` (what the plugin's clients send) is read from the
    ASGI scope's raw headers, lower-case names as ASGI requires: a comma-separated list, any
    case, every such header; none, another value or no scope: per-layer safetensors only."""
    from types import SimpleNamespace

    from vllm_hook.adapters.server import _STACKED, _TOKENLESS, _TOKENS, _accepted
    from vllm_hook.client import _TOKENS_HEADERS

    def req(*headers):
        return SimpleNamespace(scope={"type": "http", "headers": list(headers)})

    sent = _TOKENS_HEADERS["x-vllm-hook-accept"].encode()
    assert _accepted(req((b"content-type", b"application/json"), (b"x-vllm-hook-accept", sent))) == {
        _TOKENS, _STACKED, _TOKENLESS}
    assert _accepted(req((b"x-vllm-hook-accept", b"safetensors, Tokens"))) == {b"safetensors", _TOKENS}
    assert _accepted(req((b"x-vllm-hook-accept", b"tokens"), (b"x-vllm-hook-accept", b"stacked"))) == {_TOKENS, _STACKED}
    assert _STACKED not in _accepted(req((b"x-vllm-hook-accept", b"unstacked, tokens")))
    assert _TOKENS not in _accepted(req((b"x-vllm-hook-accept", b"safetensors")))
    assert not _accepted(req((b"content-type", b"application/json"))) and not _accepted(req())
    assert not _accepted(None) and not _accepted(SimpleNamespace())


def test_a_hooked_response_renders_as_starlette_would(caplog):
    """The completion and chat routers' JSONResponse becomes the plugin's (`_patch_router`, on
    the installed vLLM's modules; undone after): a body with the "vllm_hook" field gets the
    field from msgspec, appended to what starlette rendered of the rest; the bytes are
    starlette's own. Other bodies are starlette's alone. The field holds no floats (msgspec
    writes NaN as null, where starlette raises)."""
    import base64
    import importlib
    import json
    from types import SimpleNamespace

    import torch
    from starlette.responses import JSONResponse

    from vllm_hook.adapters import server
    from vllm_hook.config import HookConfig
    from vllm_hook.results import Results
    from vllm_hook.server import encode
    from vllm_hook.server.encode import stream_chunk, with_field
    from vllm_hook.server.store import ResultStore

    routers = [importlib.import_module(name) for name in server.ROUTERS]
    before = [m.JSONResponse for m in routers]
    try:
        for m in routers:
            server._patch_router(m)
            server._patch_router(m)                      # once: the subclass is not wrapped again
        assert all(getattr(m.JSONResponse, "__vllm_hook__", False) for m in routers)
        ours = routers[0].JSONResponse
        assert routers[1].JSONResponse is ours and ours.__mro__[1] is before[0]
    finally:
        for m, cls in zip(routers, before):
            m.JSONResponse = cls
    field = {"results": [{"index": 0, "format": "safetensors", "bytes": 30, "handle": None,
                          "data": base64.b64encode(bytes(range(30))).decode(),
                          "errors": ['ünïcode "quoted"\n\\ and \u2028'], "meta": {"n": [1, 2]}}]}
    for body in ({"id": "cmpl-1", "choices": [{"text": "é\t\"x\"", "logprobs": None}], "usage": {"a": 1.5},
                  "vllm_hook": field}, {"vllm_hook": field}, {"id": "e", "error": {"code": 400}}):
        assert ours(content=dict(body)).body == JSONResponse(content=dict(body)).body
    assert json.loads(with_field(b'{ "a" : 1 } ', field)) == {"a": 1, "vllm_hook": field}
    with pytest.raises(ValueError):
        with_field(b"[1]", field)
    event = stream_chunk({"id": "cmpl-1", "created": 3, "model": "m"}, field)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: "):]) == {"id": "cmpl-1", "created": 3, "model": "m", "object": "vllm_hook.results",
                                                 "choices": [], "vllm_hook": field}
    with caplog.at_level("WARNING", logger="vllm_hook"):      # a router without it: said, left as it is
        server._patch_router(SimpleNamespace(__name__="vllm.some_router"))
    assert "has no JSONResponse" in caplog.text

    # A payload as the server makes it (a capture, a tokens entry, an error, a handle) holds
    # nothing msgspec would write differently from the standard library: no floats.
    cfg = HookConfig()
    sink = encode.Sink()
    cap = Results(request_id="a", prompt_len=2, token_ids=[1, 2, 3], errors=["x"], widen_to="float32",
                  activations={"resid_post": {0: torch.ones(1, 4), 1: torch.ones(1, 4)}},
                  positions={"resid_post": {0: torch.tensor([1]), 1: torch.tensor([1])}})
    sink.fill(sink.reserve(), cap)
    sink.fill(sink.reserve(), Results(request_id="b", prompt_len=1, token_ids=[5, 6]))
    big = ResultStore(cfg.max_retained_bytes, 60)
    small = HookConfig(max_inline_result_bytes=16)
    for c in (cfg, small):
        body = encode.payload(sink, big, c, {1: ([5], [6])}, stacked=True)

        def floats(x):
            if isinstance(x, dict):
                return any(floats(v) for v in x.values())
            if isinstance(x, list):
                return any(floats(v) for v in x)
            return isinstance(x, float)

        assert not floats(body) and {e["format"] for e in body["results"]} == {"safetensors", "tokens"}


@pytest.mark.parametrize("ahead", [False, True])
def test_tokenless_results_read_their_tokens_from_the_choice(ahead):
    """A client that reads tokenless safetensors (`TOKENLESS`) and whose response shows the
    choice's tokens gets the results without token ids, the entry marked "tokens": "choice",
    made at the finish or ahead (`Ready`, while the request decoded); it reads back the same
    Results as from full safetensors. A choice that shows other tokens, or a client that does
    not read them, gets full safetensors."""
    import pybase64
    import torch

    from vllm_hook.client import _decode
    from vllm_hook.config import HookConfig
    from vllm_hook.results import Results
    from vllm_hook.server import encode
    from vllm_hook.server.store import ResultStore

    r = Results(request_id="cmpl-1-0", prompt_len=3, token_ids=[5, 6, 7, 8, 9], model="m")
    for L in (1, 2):
        r.activations.setdefault("resid_post", {})[L] = torch.randn(1, 8).to(torch.bfloat16)
        r.positions.setdefault("resid_post", {})[L] = torch.tensor([2])
    r.widen_to = "float32"
    if ahead:
        r.__dict__[encode.READY] = encode.Ready(r, True)
    cfg, store = HookConfig(), ResultStore(1 << 20, 60)
    shown = {0: ([5, 6, 7], [8, 9])}
    entry = encode.encode_one(r, 0, store, cfg, shown, stacked=True, tokenless=True)
    full = encode.encode_one(r, 0, store, cfg, shown, stacked=True)
    assert entry["tokens"] == encode.CHOICE and "tokens" not in full and entry["bytes"] < full["bytes"]
    got = _decode(entry, pybase64.b64decode(entry["data"]), shown)
    ref = _decode(full, pybase64.b64decode(full["data"]), {})
    assert got.token_ids == ref.token_ids == r.token_ids and got.prompt_len == 3 and got.ok
    for L in (1, 2):
        assert torch.equal(got.activations["resid_post"][L], ref.activations["resid_post"][L])
        assert got.activations["resid_post"][L].dtype == torch.float32
    other = encode.encode_one(r, 0, store, cfg, {0: ([5, 6, 7], [8])}, stacked=True, tokenless=True)
    assert "tokens" not in other and _decode(other, pybase64.b64decode(other["data"]), {}).token_ids == r.token_ids
    # the choice missing at the client: said, not guessed
    assert not _decode(entry, pybase64.b64decode(entry["data"]), {}).ok


def test_result_store_keeps_files_for_local_clients(tmp_path):
    """`ResultStore.put(local=True)` keeps a result as a 0600 file named for its handle: HTTP
    reads of it read the file; pop, delete, expiry and eviction remove it; a file that cannot
    be written leaves the bytes in memory. Expired files are swept at start."""
    import os
    import time

    from vllm_hook.server.store import LOCAL_PREFIX, ResultStore

    now = [0.0]
    store = ResultStore(100, 10, clock=lambda: now[0], local_dir=str(tmp_path))
    h = store.put(b"x" * 40, local=True)
    path = store.path(h)
    # named for its deadline and a token of its own: a listing of the directory shows no handle
    assert path and os.path.basename(path).startswith(LOCAL_PREFIX) and h not in path
    assert os.stat(path).st_mode & 0o777 == 0o600 and open(path, "rb").read() == b"x" * 40
    assert store.get(h) == b"x" * 40 and store.stats().local == 1 and store.stats().bytes == 40
    assert store.pop(h) == b"x" * 40 and not os.path.exists(path) and store.stats().bytes == 0
    # delete, eviction (oldest first) and expiry remove the files too
    a, b = store.put(b"a" * 60, local=True), store.put(b"b" * 30, local=True)
    pa, pb = store.path(a), store.path(b)
    assert store.delete(b) and not os.path.exists(pb) and not store.delete(b)
    c = store.put(b"c" * 50, local=True)                      # 60 + 50 > 100: a goes
    assert store.get(a) is None and not os.path.exists(pa) and store.stats().dropped == 1
    now[0] = 11
    pc = store.path(c)
    assert store.get(c) is None and not os.path.exists(pc)
    # not local: in memory, no path
    d = store.put(b"d" * 10)
    assert store.path(d) is None and store.get(d) == b"d" * 10
    # a directory it cannot write: in memory
    ro = ResultStore(100, 10, local_dir=str(tmp_path / "missing"))
    e = ro.put(b"e" * 10, local=True)
    assert ro.local_dir is None and ro.path(e) is None and ro.get(e) == b"e" * 10
    # files past the deadline in their names (a crashed server's) are swept at start, others kept
    old, new = tmp_path / f"{LOCAL_PREFIX}1000-zz", tmp_path / f"{LOCAL_PREFIX}{int(time.time()) + 3600}-yy"
    old.write_bytes(b"1")
    new.write_bytes(b"1")
    ResultStore(100, 10, local_dir=str(tmp_path))
    assert not old.exists() and new.exists()
    # no room on its file system (a quarter of it for files), or a write that failed: in memory
    small = ResultStore(100, 10, local_dir=str(tmp_path))
    small._file_limit = 30
    f = small.put(b"f" * 40, local=True)
    assert small.path(f) is None and small.get(f) == b"f" * 40
    small._file_limit = 1000
    small.local_dir = str(tmp_path / "gone")          # the write fails: memory, then a pause
    g = small.put(b"g" * 10, local=True)
    assert small.path(g) is None and small.get(g) == b"g" * 10 and small._full_until > 0
    small.local_dir = str(tmp_path)
    assert small.path(small.put(b"h", local=True)) is None     # within the pause
    # a file removed behind the server's back: the entry goes too
    k = store.put(b"k" * 10, local=True)
    os.unlink(store.path(k))
    assert store.get(k) is None and store.path(k) is None
    # a large result's unjoined parts (`StParts`): written to the file from its tensors, or
    # joined into bytes in memory (not local, or no room for the file)
    import torch

    from vllm_hook.delivery.store import StParts

    parts = StParts({"x": torch.arange(4, dtype=torch.int16)}, {})
    want = parts.to_bytes()
    big = ResultStore(1000, 10, local_dir=str(tmp_path))
    p1, p2 = big.put(parts, local=True), big.put(parts)
    assert open(big.path(p1), "rb").read() == want and big.stats().bytes == 2 * len(want)
    assert big.path(p2) is None and bytes(big.get(p2)) == want and bytes(big.pop(p1)) == want
    big._file_limit = 0
    p3 = big.put(parts, local=True)
    assert big.path(p3) is None and bytes(big.pop(p3)) == want


def test_result_store_reuses_the_files_of_entries_gone(tmp_path):
    """A file whose client is done with it (deleted, popped) is kept under a name no entry
    holds, and the next result as large or up to half as large takes it over (its pages:
    the same inode) under a name of its own, cut to its size. Never kept: a file whose entry
    expired or was evicted, or that a fetch is reading (its reader may not be done). A kept
    file that vanished, or was replaced, is not written: a new file instead. Beyond the bound
    kept files are deleted; the server's exit removes them; a write that raises leaves
    nothing behind."""
    import gc
    import os

    import pytest

    from vllm_hook.server.store import LOCAL_PREFIX, ResultStore

    def names():
        return sorted(n for n in os.listdir(tmp_path) if n.startswith(LOCAL_PREFIX))

    now = [0.0]
    st = ResultStore(1000, 10, clock=lambda: now[0], local_dir=str(tmp_path))
    a = st.put(b"a" * 100, local=True)
    pa = st.path(a)
    inode = os.stat(pa).st_ino
    assert st.pop(a) == b"a" * 100 and not os.path.exists(pa)
    assert len(names()) == 1 and st._free_bytes == 100 and [f[3] for f in st._free] == [inode]
    b = st.put(b"b" * 60, local=True)                 # up to half as large: takes it over, cut
    path = st.path(b)
    assert os.stat(path).st_ino == inode and open(path, "rb").read() == b"b" * 60
    assert os.stat(path).st_mode & 0o777 == 0o600 and st._free == [] and names() == [os.path.basename(path)]
    assert st.delete(b) and len(st._free) == 1
    c = st.put(b"c" * 20, local=True)                 # under half the kept one's size: a new file
    assert os.stat(st.path(c)).st_ino != inode and len(st._free) == 1
    # expired (or evicted): deleted, never kept
    pc = st.path(c)
    now[0] = 11
    assert st.get(c) is None and not os.path.exists(pc) and len(st._free) == 1
    # a file a fetch is reading when its entry goes is deleted, not kept
    d = st.put(b"d" * 60, local=True)                 # takes over the kept 60-byte file
    pd = st.path(d)
    assert os.stat(pd).st_ino == inode and st._free == []
    st._reading[pd] = 1
    assert st.delete(d) and not os.path.exists(pd) and st._free == [] and st._free_bytes == 0
    del st._reading[pd]
    # a kept file that vanished, or was replaced by another file, is not written
    e = st.put(b"e" * 50, local=True)
    st.delete(e)
    os.unlink(st._free[0][1])
    f = st.put(b"f" * 50, local=True)
    assert open(st.path(f), "rb").read() == b"f" * 50 and st._free == [] and st._free_bytes == 0
    st.delete(f)
    kept = st._free[0][1]
    os.unlink(kept)
    other = tmp_path / "other"                    # the same name, another file (a second link
    other.write_bytes(b"z" * 50)                  # to it): left as it is
    os.link(other, kept)
    g = st.put(b"g" * 50, local=True)
    assert st.get(g) == b"g" * 50 and other.read_bytes() == b"z" * 50
    os.unlink(other)
    st._full_until = 0.0
    for n in names():
        os.unlink(tmp_path / n)
    st.delete(g)
    # beyond the bound (bytes), files are deleted
    st._free.clear()                               # (the finalizer holds this list)
    st._free_bytes, st._free_limit = 0, 150
    h1, h2 = st.put(b"h" * 100, local=True), st.put(b"i" * 100, local=True)
    p2 = st.path(h2)
    st.delete(h1)
    assert st.delete(h2) and not os.path.exists(p2) and st._free_bytes == 100 and len(names()) == 1
    # a write that raises (not an OSError) leaves no file and no reservation
    before = st._file_bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError):
            st.put(b"j" * 120, local=True)             # (120: none kept fits: a new file)
    assert st._file_bytes == before and len(names()) == 1
    # the store's finalizer (when it is collected, or at exit) removes kept files too
    st._free_limit = 1000
    k = st.put(b"k" * 10, local=True)
    st.delete(st.put(b"l" * 10, local=True))
    assert st.path(k) and len(st._free) == 2
    st._finalizer()
    assert names() == []

    def used_and_dropped():
        other = ResultStore(1000, 10, local_dir=str(tmp_path))
        other.delete(other.put(b"m" * 10, local=True))
        other.put(b"n" * 30, local=True)             # (none kept holds it: a file of its own)
        assert len(names()) == 2

    used_and_dropped()
    gc.collect()
    assert names() == []


def test_client_reads_only_its_result_files(tmp_path):
    """The client reads an entry's file only where it is a regular file named as the server
    names result files (an absolute path, no link followed), of the entry's size, and only
    when it reads files at all (`local_results`); anything else is fetched by handle. By
    default it asks for files only from a server at a loopback address."""
    import os

    import httpx

    from vllm_hook import client as client_mod
    from vllm_hook.server.store import LOCAL_PREFIX

    good = tmp_path / f"{LOCAL_PREFIX}12-tok"
    good.write_bytes(b"abc")
    entry = {"handle": "hdl", "local": str(good), "bytes": 3, "data": None}
    assert client_mod._read_local(entry) == b"abc"
    large = tmp_path / f"{LOCAL_PREFIX}12-large"           # from 1 MiB: into reused memory
    payload = os.urandom(3 << 20)
    large.write_bytes(payload)
    assert bytes(client_mod._read_local({**entry, "local": str(large), "bytes": len(payload)})) == payload
    datas, fetch, release = client_mod._plan([entry, {"handle": "h2", "data": None}], True)
    assert datas[0] == b"abc" and fetch == [1] and release == ["hdl"]
    assert client_mod._plan([entry], False) == ([None], [0], [])
    other = tmp_path / "secret"
    other.write_bytes(b"abc")
    link = tmp_path / f"{LOCAL_PREFIX}13-link"
    link.symlink_to(other)
    fifo = tmp_path / f"{LOCAL_PREFIX}14-fifo"
    os.mkfifo(fifo)
    for bad in ({**entry, "bytes": 4}, {**entry, "local": str(other)}, {**entry, "local": f"{LOCAL_PREFIX}12-tok"},
                {**entry, "local": str(tmp_path / f"{LOCAL_PREFIX}1-none")}, {**entry, "local": str(link)},
                {**entry, "local": str(fifo)}, {**entry, "local": str(good) + "\0"}, {**entry, "bytes": None}):
        assert client_mod._read_local(bad) is None, bad
    assert client_mod._releases([str(i) for i in range(5000)])[1]["handles"][0] == "4096"
    for url, local in (("http://127.0.0.1:8000", True), ("http://localhost:1", True), ("http://[::1]:8000", True),
                       ("http://10.0.0.7:8000", False), ("https://example.org", False)):
        assert client_mod._loopback(httpx.URL(url)) is local, url
        assert client_mod.Client(url).local_results is local
        assert client_mod.Client(url, local_results=not local).local_results is not local


def test_fetched_bodies_are_received_whole_into_reused_memory():
    """A result fetched by handle from 1 MiB is received into reused memory as its pieces
    come (`client._Body`), by both clients; a body shorter or longer than its content-length
    is an error, and a small or content-encoded one is read as bytes."""
    import asyncio
    import gzip
    import os

    import httpx

    from vllm_hook import client as client_mod

    payload = os.urandom(3 << 20)
    packed = gzip.compress(payload, compresslevel=1)

    def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.path.rsplit("/", 1)[-1]
        sized = {"short": len(payload) + 5, "long": len(payload) - 5, "whole": len(payload)}
        if name in sized:
            return httpx.Response(200, headers={"content-length": str(sized[name])}, stream=httpx.ByteStream(payload))
        if name == "gzip":
            return httpx.Response(200, headers={"content-length": str(len(packed)), "content-encoding": "gzip"},
                                  stream=httpx.ByteStream(packed))
        if name == "small":
            return httpx.Response(200, content=b"abc")
        return httpx.Response(404, json={"error": {"message": "no such result"}})

    def check(fetch):
        got = yield fetch("whole")
        assert isinstance(got, memoryview) and bytes(got) == payload
        got = yield fetch("gzip")
        assert isinstance(got, bytes) and got == payload        # decoded, as bytes
        assert (yield fetch("small")) == b"abc"

    def run_sync():
        c = client_mod.Client("http://127.0.0.1:1", http=httpx.Client(base_url="http://127.0.0.1:1",
                                                                       transport=httpx.MockTransport(handler)))
        steps = check(c._fetch)
        got = next(steps)
        try:
            while True:
                got = steps.send(got)
        except StopIteration:
            pass
        for bad, why in (("short", "ended at"), ("long", "ran past")):
            with pytest.raises(httpx.RemoteProtocolError, match=why):
                c._fetch(bad)
        with pytest.raises(client_mod.NotFoundError):
            c._fetch("missing")

    async def run_async():
        http = httpx.AsyncClient(base_url="http://127.0.0.1:1", transport=httpx.MockTransport(handler))
        async with client_mod.AsyncClient("http://127.0.0.1:1", http=http) as ac:
            steps = check(ac._fetch)
            got = await next(steps)
            try:
                while True:
                    got = await steps.send(got)
            except StopIteration:
                pass
            for bad, why in (("short", "ended at"), ("long", "ran past")):
                with pytest.raises(httpx.RemoteProtocolError, match=why):
                    await ac._fetch(bad)
            with pytest.raises(client_mod.NotFoundError):
                await ac._fetch("missing")

    run_sync()
    asyncio.run(run_async())


def test_async_client_releases_in_the_background_in_few_calls():
    """`AsyncClient` releases results read from files in the background: the responses read
    in one turn of the loop in one call, those read while it is in flight in the next;
    `release_pending` waits; a failed call is a warning, and later ones still go."""
    import asyncio
    import json

    import httpx

    from vllm_hook import client as client_mod

    calls, fail = [], []

    async def handler(request: httpx.Request) -> httpx.Response:
        handles = json.loads(request.content)["handles"]
        calls.append(handles)
        await asyncio.sleep(0.01)           # in flight while more are queued
        if fail:
            return httpx.Response(500, json={"error": {"message": "down"}})
        return httpx.Response(200, json={"released": len(handles)})

    async def main():
        http = httpx.AsyncClient(base_url="http://127.0.0.1:1", transport=httpx.MockTransport(handler))
        async with client_mod.AsyncClient("http://127.0.0.1:1", http=http) as ac:
            for i in range(5):                       # one turn of the loop: one call
                ac._release_soon([f"a{i}"])
            await asyncio.sleep(0.005)               # that call in flight: these queue
            ac._release_soon(["b0"])
            ac._release_soon(["b1"])
            await ac.release_pending()
            assert calls == [[f"a{i}" for i in range(5)], ["b0", "b1"]]
            fail.append(True)
            ac._release_soon(["c0"])
            with pytest.warns(RuntimeWarning, match="HTTP 500.*result_ttl_s"):
                await ac.release_pending()
            fail.clear()
            ac._release_soon(["d0"])                 # closing the client waits for it
        assert calls[-1] == ["d0"]
    asyncio.run(main())


