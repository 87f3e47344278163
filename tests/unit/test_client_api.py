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
    """`x-vllm-hook-accept: tokens, stacked` (what the plugin's clients send) is read from the
    ASGI scope's raw headers, lower-case names as ASGI requires; none, another value or no
    scope: per-layer safetensors entries only."""
    from types import SimpleNamespace

    from vllm_hook.adapters.server import _STACKED, _TOKENS, _accepted
    from vllm_hook.client import _TOKENS_HEADERS

    def req(*headers):
        return SimpleNamespace(scope={"type": "http", "headers": list(headers)})

    sent = _TOKENS_HEADERS["x-vllm-hook-accept"].encode()
    assert _TOKENS in _accepted(req((b"content-type", b"application/json"), (b"x-vllm-hook-accept", sent)))
    assert _STACKED in _accepted(req((b"x-vllm-hook-accept", sent)))
    assert _TOKENS in _accepted(req((b"x-vllm-hook-accept", b"safetensors, tokens")))
    assert _STACKED not in _accepted(req((b"x-vllm-hook-accept", b"tokens")))
    assert _TOKENS not in _accepted(req((b"x-vllm-hook-accept", b"safetensors")))
    assert _accepted(req((b"content-type", b"application/json"))) == b""
    assert _accepted(req()) == b"" and _accepted(None) == b"" and _accepted(SimpleNamespace()) == b""


def test_a_hooked_response_renders_as_starlette_would():
    """The completion and chat routers' JSONResponse is the plugin's (`adapters.server`): a
    body with the "vllm_hook" field gets the field from msgspec, appended to what starlette
    rendered of the rest; the bytes are starlette's own. Other bodies are starlette's alone."""
    import base64
    import importlib
    import json

    from starlette.responses import JSONResponse

    from vllm_hook.adapters import server
    from vllm_hook.server.encode import stream_chunk, with_field

    server.install()
    routers = [importlib.import_module(name) for name in server.ROUTERS]
    assert all(getattr(m.JSONResponse, "__vllm_hook__", False) for m in routers)
    ours = routers[0].JSONResponse
    assert routers[1].JSONResponse is ours and issubclass(ours, JSONResponse)
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
