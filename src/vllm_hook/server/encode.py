"""Per-HTTP-request collection of results and their encoding into the JSON response.

A `Sink` gathers the `Results` of the engine requests one HTTP request makes (one per prompt;
`n > 1` gives a list per prompt). The API-server patches fill it; `payload` turns it into
the `"vllm_hook"` field: inline base64 safetensors when small enough, a handle otherwise; a
result of nothing but its tokens, for a client that accepts it (`ACCEPT_HEADER`, which the
plugin's clients send) and whose choice in the response shows them (`return_token_ids`), as
its errors and metadata alone ("format": "tokens").
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from typing import Any, Mapping

import msgspec
import pybase64
from pydantic import BaseModel

from ..config import HookConfig
from ..delivery.store import StParts
from ..results import Results
from .store import ResultStore

FORMAT = "safetensors"
TOKENS = "tokens"        # no tensors: the tokens are the response choice's (see `bare`)
STACKED = "stacked"      # a site's layers as one tensor (`Results.to_bytes(stacked=True)`)
# safetensors without token ids, the entry marked "tokens": "choice": its choice in the
# response shows them (`Results.to_bytes(tokens=False)`; such bytes may be made early, `Ready`)
TOKENLESS = "tokenless"
CHOICE = "choice"
# Results too large to inline as files the client reads itself (`ResultStore.put(local=True)`):
# the entry's "local" is the file's path (the handle stays the way over HTTP).
LOCAL = "local"
# A request header by which a client says what it reads beyond per-layer safetensors: "tokens"
# entries, "stacked" sites, "tokenless" safetensors, "local" files (older clients read none).
ACCEPT_HEADER = "x-vllm-hook-accept"
STREAM_OBJECT = "vllm_hook.results"
FIELD = "vllm_hook"      # the response's field (non-streamed) and the stream event's
# The field's JSON: msgspec (a vLLM dependency). The standard library's encoder took 202 to
# 230 µs for a 4-layer capture's response (19 KB of base64) on the lent H100 hosts' Python 3.12
# (runs 135 to 137; 34 on the CI machine), the plugin's rendering 14 to 24 (14). The field
# holds no floats (a unit test keeps it so): msgspec's NaN-as-null never applies to it.
_JSON = msgspec.json.Encoder()

_CURRENT: ContextVar["Sink | None"] = ContextVar("vllm_hook_sink", default=None)


class Sink:
    def __init__(self):
        self.slots: list[Results | list[Results] | None] = []
        self.error: BaseException | None = None     # what an engine request raised, if any

    def reserve(self) -> int:
        """One slot per engine request, in the order the server makes them (= prompt order)."""
        self.slots.append(None)
        return len(self.slots) - 1

    def fill(self, slot: int, results: Results | list[Results]) -> None:
        self.slots[slot] = results


def current() -> Sink | None:
    return _CURRENT.get()


class collecting:
    """`with collecting() as sink:` the engine requests made inside fill `sink` (a class, not
    a generator context manager: entered once per hooked HTTP request)."""

    __slots__ = ("sink", "token")

    def __enter__(self) -> Sink:
        self.sink = Sink()
        self.token = _CURRENT.set(self.sink)
        return self.sink

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self.token)


# Encoded on the event loop below this many bytes of activations; larger ones on a thread
# of their own (`adapters.server._encode`), and not made ahead (`Ready`).
ON_LOOP_BELOW = 256 << 10


def result_nbytes(r: Results) -> int:
    """The bytes of one result's activations (what its encoding copies)."""
    return sum(t.numel() * t.element_size() for per_layer in r.activations.values() for t in per_layer.values())


def nbytes(sink: Sink) -> int:
    """The bytes of the activations a sink holds."""
    return sum(result_nbytes(r) for r in _results(sink))


def _field(obj: Any, key: str) -> Any:
    """A field of a response part: a dict, or a pydantic object (vLLM's response models, the
    `openai` package's; extra fields included)."""
    if isinstance(obj, Mapping):
        return obj.get(key)
    if isinstance(obj, BaseModel):
        # its fields are in its __dict__: getattr of an absent one raises inside pydantic
        # (6 µs a response of the server's check, most of it that)
        got = obj.__dict__.get(key)
        return got if got is not None else (obj.__pydantic_extra__ or {}).get(key)
    got = getattr(obj, key, None)
    return got if got is not None else (getattr(obj, "model_extra", None) or {}).get(key)


def shown_tokens(response: Any) -> dict[int, tuple[list, list]]:
    """Choice index -> (prompt token ids, generated token ids) a non-streamed completion or
    chat response shows (chat: the prompt's at the top); choices without both are left out.
    The server's check before a "tokens" entry and the client's reading of one, alike."""
    top = _field(response, "prompt_token_ids")
    shown = {}
    for c in _field(response, "choices") or ():
        prompt = _field(c, "prompt_token_ids")
        prompt = top if prompt is None else prompt
        gen = _field(c, "token_ids")
        if prompt is not None and gen is not None:
            shown[_field(c, "index")] = (prompt, gen)
    return shown


def _results(sink: Sink):
    """Every Results the sink holds (children of an n > 1 request one by one)."""
    for got in sink.slots:
        if got is not None:
            yield from (got if isinstance(got, list) else (got,))


def _rowless(r: Results) -> bool:
    return not (r.activations or r.hook_results or r.heads)


def any_tokens_only(sink: Sink) -> bool:
    """Whether any of the sink's results is nothing but its tokens and errors (`bare` may
    then hold, given the response's token ids)."""
    return any(_rowless(r) for r in _results(sink))


def bare(r: Results, shown: tuple[list, list] | None) -> bool:
    """Whether `r` is nothing but its tokens and errors, and those tokens are the ones its
    choice in the response shows (`shown`: its prompt's and generated token ids): then its
    entry needs no safetensors, the client builds the same Results from the choice (a
    steering-only request: encoding and decoding them were most of what serving its results
    cost)."""
    return _rowless(r) and _shows(r, shown)


class Ready:
    """A result's inline entry data made ahead (while its request decoded): its tokenless
    safetensors (`Results.to_bytes(stacked, tokens=False)`) in base64, kept on the Results
    (`READY`) and used by `encode_one` when the client reads tokenless sites, stacked alike."""

    __slots__ = ("stacked", "data", "nbytes")

    def __init__(self, r: Results, stacked: bool):
        blob = r.to_bytes(stacked, tokens=False)
        self.stacked, self.nbytes = stacked, len(blob)
        self.data = pybase64.b64encode_as_string(blob)


READY = "_vllm_hook_ready"      # a Results' `Ready`, in its __dict__


def _shows(r: Results, shown: tuple[list, list] | None) -> bool:
    """Whether the response's choice shows exactly `r`'s tokens (`shown`: prompt's, generated)."""
    if shown is None:
        return False
    prompt, gen = shown
    return r.prompt_len == len(prompt) and r.token_ids == [*prompt, *gen]


def encode_one(r: Results, index: int, store: ResultStore, cfg: HookConfig,
               shown: dict[int, tuple[list, list]] | None = None, stacked: bool = False,
               tokenless: bool = False, local: bool = False, threaded: bool = False) -> dict[str, Any]:
    if shown is not None and bare(r, shown.get(index)):
        # `meta`: what the tokens do not tell (its "index" is the Results' own: the child of
        # an n > 1 request; the entry's is the response's choice)
        return {"index": index, "format": TOKENS, "bytes": 0, "data": None, "handle": None,
                "errors": list(r.errors),
                "meta": {"request_id": r.request_id, "index": r.index, "model": r.model}}
    choice = tokenless and shown is not None and _shows(r, shown.get(index))
    ready = r.__dict__.get(READY) if choice else None
    if ready is not None and ready.stacked == stacked and ready.nbytes <= cfg.max_inline_result_bytes:
        return {"index": index, "format": FORMAT, "bytes": ready.nbytes, "data": ready.data,
                "handle": None, "errors": list(r.errors), "tokens": CHOICE}
    # Too large to inline (its activations alone) and for a client that reads files: written
    # to its file from the tensors (`StParts`), no bytes object made of them first. In memory
    # a result is one bytes object, which a fetch sends without a copy; on the encoding
    # threads (`threaded`) joined from its parts too, byte copies where `to_bytes` would stack
    # a site's layers with torch first (each encoding thread waking a team of torch's threads;
    # a hook result of a dtype `StParts` lacks still goes through `to_bytes`)
    to_file = local and cfg.local_results and result_nbytes(r) > cfg.max_inline_result_bytes
    if to_file or (threaded and r.activations):
        data = r.to_parts(stacked, tokens=not choice)
        if not to_file and isinstance(data, StParts):
            data = data.to_bytes()
    else:
        data = r.to_bytes(stacked, tokens=not choice)
    entry = {"index": index, "format": FORMAT, "bytes": len(data), "data": None, "handle": None,
             "errors": list(r.errors)}
    if choice:
        entry["tokens"] = CHOICE
    if len(data) <= cfg.max_inline_result_bytes:
        # SIMD base64 (a vLLM dependency): 15 KB in 1 µs, the standard library's 22 µs
        entry["data"] = pybase64.b64encode_as_string(data)
    else:
        entry["handle"] = store.put(data, local=local and cfg.local_results)
        path = store.path(entry["handle"]) if local and entry["handle"] else None
        if path:
            entry[LOCAL] = path
        if entry["handle"] is None:
            entry["errors"].append(
                f"results of {len(data)} bytes exceed max_retained_bytes={store.max_bytes} and "
                "were dropped; capture fewer layers or tokens, or raise "
                "additional_config vllm_hook.max_retained_bytes")
    return entry


def payload(sink: Sink, store: ResultStore, cfg: HookConfig,
            shown: dict[int, tuple[list, list]] | None = None, stacked: bool = False,
            tokenless: bool = False, local: bool = False, threaded: bool = False) -> dict[str, Any]:
    """The `"vllm_hook"` field. `index` is the response's choice index (prompt * n + child).
    `shown`: the token ids (prompt's, generated) the response shows for each choice index
    (`shown_tokens`), for a client that reads "tokens" entries; None: safetensors only
    (a stream, whose results event stands alone, or another client). `stacked`: the client
    reads stacked sites; `tokenless`: tokenless safetensors (with `shown`); `local`: the
    client reads files (`LOCAL`); `threaded`: encoded on an encoding thread (no torch work
    there, `encode_one`)."""
    entries = []
    for slot, got in enumerate(sink.slots):
        if got is None:
            continue
        group = got if isinstance(got, list) else [got]
        for r in group:
            entries.append(encode_one(r, slot * len(group) + r.index, store, cfg, shown, stacked, tokenless,
                                      local, threaded))
    return {"results": sorted(entries, key=lambda e: e["index"])}


def chunk_meta(chunk: str) -> dict[str, Any]:
    """id/created/model of an SSE chunk of the OpenAI stream (to label ours the same way)."""
    try:
        body = json.loads(chunk.strip()[len("data:"):])
    except ValueError:
        return {}
    return {k: body[k] for k in ("id", "created", "model") if isinstance(body, dict) and k in body}


def with_field(rendered: bytes, body: dict[str, Any]) -> bytes:
    """`rendered`, a JSON object's bytes (the response vLLM rendered without our field), with
    the `"vllm_hook"` field added last (where the response model's extra field went)."""
    head = rendered.rstrip()
    if not head.endswith(b"}"):
        raise ValueError("not a JSON object")
    head = head[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return b"".join((head, sep, b'"', FIELD.encode(), b'":', _JSON.encode(body), b"}"))


def stream_chunk(meta: dict[str, Any], body: dict[str, Any]) -> str:
    """The extra SSE event sent just before `data: [DONE]`."""
    event = {**meta, "object": STREAM_OBJECT, "choices": [], FIELD: body}
    return f"data: {_JSON.encode(event).decode()}\n\n"


def is_done(chunk: Any) -> bool:
    return isinstance(chunk, str) and chunk.strip() == "data: [DONE]"
