"""HTTP clients for a `vllm serve` with vllm-hook: the offline API, over the network.

    client = vllm_hook.Client("http://localhost:8000", api_key="...")
    out = client.generate("Tell me about the sea.", spec, max_tokens=32, temperature=0)
    out.text, out.token_ids, out.results.activations["resid_post"][12]

`Client` is synchronous, `AsyncClient` has the same methods as coroutines (`stream` /
`stream_chat` return a `Stream` to iterate, or `async for`, then read `.results`). Results come back
as the same `Results` objects as offline; results too large to travel inline are read from
their files where the client asked for them and can open them (`local_results`: by default
for a server at a loopback address), else fetched by handle, and then deleted on the server; a steering-only result comes as its choice's tokens
(docs/serve.md, "The response"). `Client.results_of(response)` does the same for a whole
response (or the extra stream event) obtained with the `openai` package. Request bodies are
written and completions read with msgspec.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import os
import stat
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import httpx
import msgspec
import pybase64
import torch

from .delivery.hostmem import RECYCLE_FROM, host_empty, read_into
from .hooks.hook import Hook
from .hooks.state import decode_collected
from .results import Results
from .server.encode import ACCEPT_HEADER, CHOICE, LOCAL, STACKED, TOKENLESS, TOKENS, shown_tokens
from .server.store import LOCAL_PREFIX, MAX_RELEASE
from .spec.errors import SpecError, UnknownVectorError
from .spec.schema import SPEC_KEY, HookSpec
from .spec.vectors import encode_vector

DEFAULT_TIMEOUT = 600.0
# httpx's default of 100 connections would hold a batch of 256 concurrent requests to 100 in
# flight at the server. Few are kept alive: httpx's pool slows as it fills with idle
# connections (encode/httpx#3215; docs/benchmarks.md, runs 78 to 80).
ASYNC_LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=20)


class ServerError(Exception):
    """The server refused a request (`status` is the HTTP status)."""

    def __init__(self, status: int, message: str, body: Any = None):
        Exception.__init__(self, f"HTTP {status}: {message}")  # not super(): SpecError's init differs
        self.status, self.message, self.body = status, message, body


class NotFoundError(ServerError, LookupError):
    """HTTP 404 for something other than a steering vector: an unknown result handle (fetched
    already, or past its TTL), an unknown model, or a server without vllm-hook's routes."""


class RemoteSpecError(ServerError, SpecError):
    """The server rejected the spec (HTTP 400); also catchable as `vllm_hook.SpecError`."""

    def __init__(self, status: int, message: str, body: Any = None):
        ServerError.__init__(self, status, message, body)
        self.where, self.problem, self.fix = "", message, ""


class RemoteUnknownVectorError(RemoteSpecError, UnknownVectorError):
    """A steering op named a vector the server does not have (HTTP 404)."""


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None
    finish_reason: str | None
    results: Results | None = None


@dataclass
class Generation:
    """One completion or chat response. `text`, `token_ids` and `results` are choice 0's."""

    id: str
    choices: list[Choice]
    usage: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int] | None:
        return self.choices[0].token_ids

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return self.choices[0].prompt_token_ids

    @property
    def results(self) -> Results | None:
        return self.choices[0].results


# ---- what both clients share: request bodies and response parsing ---------------------------

def spec_json(spec: Any) -> str:
    """A spec (dict, HookSpec or JSON string) as the JSON string `vllm_xargs` carries. Tensor
    and numpy vectors travel as exact base64 float32."""
    if isinstance(spec, (str, bytes)):
        return spec if isinstance(spec, str) else spec.decode()
    if isinstance(spec, HookSpec):
        spec = spec.model_dump(exclude_none=True)
    spec = dict(spec)
    steer = spec.get("steer")
    if steer and not all(isinstance(op.get("vector"), _AS_IS) for op in steer):
        # (ops naming a registered vector, most of them, go as they are: no copy each)
        spec["steer"] = [{**op, "vector": _wire_vector(op.get("vector"))} for op in steer]
    if spec.get("hooks"):
        spec["hooks"] = [wire_hook(h) for h in spec["hooks"]]
    # NaN allowed in a spec's text: the server refuses it with a message naming the op.
    return _json_bytes(spec, allow_nan=True).decode()


_ENCODER = msgspec.json.Encoder()


def _json_bytes(obj: Any, allow_nan: bool = False) -> bytes:
    """JSON of a request body (as httpx's `json=` wrote it: NaN refused, raising ValueError)
    or of a spec (`allow_nan`). By msgspec (the 28-op steering spec: 3 µs on the CI
    machine, json.dumps 24); by the standard library where msgspec's output could differ:
    it writes NaN and infinities as null, so any output with a null is written again. msgspec
    also encodes bytes (as base64), sets and dates, which json.dumps refuses: `_body` refuses
    a bytes prompt itself."""
    try:
        out = _ENCODER.encode(obj)
    except (TypeError, ValueError, OverflowError, RecursionError):
        out = None
    if out is None or b"null" in out:      # (real nulls are rare in a body: the slow way)
        out = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=allow_nan).encode()
    return out


def _as_json(body: Any, tokens: bool = False, local: bool = False) -> dict:
    """httpx arguments that send `body` as JSON (`_json_bytes`). `tokens`: a completion or
    chat request, whose steering-only results may come as their choice's tokens; `local`:
    whose large results may come as files (`_read_local`)."""
    return {"content": _json_bytes(body),
            "headers": (_LOCAL_HEADERS if local else _TOKENS_HEADERS) if tokens else _JSON_HEADERS}


_JSON_HEADERS = {"Content-Type": "application/json"}
_TOKENS_HEADERS = {**_JSON_HEADERS, ACCEPT_HEADER: f"{TOKENS}, {STACKED}, {TOKENLESS}"}
_LOCAL_HEADERS = {**_JSON_HEADERS, ACCEPT_HEADER: f"{TOKENS}, {STACKED}, {TOKENLESS}, {LOCAL}"}


def _loads(resp: httpx.Response) -> Any:
    """A response's JSON, decoded by msgspec (a completion with its token ids: about 4x
    faster than `Response.json()`)."""
    return msgspec.json.decode(resp.content)


def wire_hook(h: Any) -> Any:
    """A hook as JSON: operator hooks as they are; a Python `Hook` pickled (a server runs it
    only with allow_client_code)."""
    if isinstance(h, Hook):
        if h.name:
            return {"name": h.name, "args": h.args}
        return {"pickle": base64.b64encode(h.pickled()).decode("ascii")}
    return h


_AS_IS = (str, dict, list, type(None))     # vector forms JSON carries as they are


def _wire_vector(v: Any) -> Any:
    if isinstance(v, _AS_IS):
        return v
    if isinstance(v, tuple):
        return list(v)
    return encode_vector(v)


def _body(base: dict, spec: Any, sampling: dict) -> dict:
    if isinstance(base.get("prompt"), (bytes, bytearray)):
        raise TypeError("prompt must be text or a list of token ids, not bytes")
    body = {**base, **sampling}
    body.setdefault("return_token_ids", True)
    if spec is not None:
        xargs = dict(body.get("vllm_xargs") or {})
        xargs[SPEC_KEY] = spec_json(spec)
        body["vllm_xargs"] = xargs
    return body


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
        err = body.get("error", body)
        message = (str(err.get("message") or err.get("detail") or err) if isinstance(err, dict)
                   else str(err))
    except ValueError:
        body, message = resp.text, resp.text
    if "vllm_hook spec error" in message:
        cls = RemoteUnknownVectorError if resp.status_code == 404 else RemoteSpecError
        raise cls(resp.status_code, message, body)
    if resp.status_code == 404:
        path = resp.request.url.path
        if message in ("Not Found", "") and path.startswith("/v1/hook/"):
            message = (f"{path} does not exist on this server: is vllm-hook installed where "
                       "`vllm serve` runs (and VLLM_HOOK_DISABLE unset)?")
        raise NotFoundError(404, message, body)
    raise ServerError(resp.status_code, message, body)


def hook_field(response: Any) -> dict | None:
    """The `"vllm_hook"` field of a response or stream event: a dict, or an `openai` object."""
    if isinstance(response, Mapping):
        return response.get("vllm_hook")
    extra = getattr(response, "model_extra", None) or {}
    return extra.get("vllm_hook", getattr(response, "vllm_hook", None))


def _entries(response: Any) -> list[dict]:
    hook = hook_field(response)
    return sorted((hook or {}).get("results", []), key=lambda e: e["index"])


def _read_local(entry: dict) -> memoryview | None:
    """The bytes of an entry kept as a file (`"local"`: `server.store`), read here where this
    process is on the server's host and may read it; None otherwise (then it is fetched by
    handle). Whatever path a server names, only a regular file named as the server names
    result files, of the entry's size, is read (no link followed, no FIFO waited on). Read
    into reused memory from 1 MiB (`host_empty`), which returns to its pool once the
    response's results are decoded."""
    path, size = entry.get(LOCAL), entry.get("bytes")
    if not (isinstance(path, str) and os.path.isabs(path) and os.path.basename(path).startswith(LOCAL_PREFIX)
            and isinstance(size, int)):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):    # another host or user's server; a NUL in the path
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return None
        buf = host_empty((size,), torch.uint8)
        read_into(fd, buf)               # whole (OSError: the file ended early)
    except OSError:
        return None
    finally:
        os.close(fd)
    return memoryview(buf.numpy())


def _plan(entries: list[dict], local: bool) -> tuple[list[Any], list[int], list[str]]:
    """Each entry's bytes where it has them (inline, or with `local` a file read here), the
    entries to fetch by handle, and the handles read from files (to release on the server)."""
    datas = [_inline(e) for e in entries]
    fetch, release = [], []
    for i, e in enumerate(entries):
        if datas[i] is None and e.get("handle"):
            datas[i] = _read_local(e) if local else None
            if datas[i] is None:
                fetch.append(i)
            else:
                release.append(e["handle"])
    return datas, fetch, release


class _Body:
    """A fetched result's body received into reused memory (`host_empty`) from 1 MiB, as
    its pieces come, where its length is known and it is not content-encoded: joining the
    pieces made a fresh bytes object each time, whose page faults cost more than the copy."""

    def __init__(self, resp: httpx.Response):
        size = resp.headers.get("content-length", "")
        self.buf = None
        if size.isdigit() and int(size) >= RECYCLE_FROM and "content-encoding" not in resp.headers:
            self.buf = memoryview(host_empty((int(size),), torch.uint8).numpy())
        self.at = 0

    def add(self, chunk: bytes) -> None:
        end = self.at + len(chunk)
        if end > len(self.buf):
            raise httpx.RemoteProtocolError(f"a result's body ran past its content-length ({len(self.buf)} bytes)")
        self.buf[self.at:end] = chunk
        self.at = end

    def done(self) -> memoryview:
        if self.at != len(self.buf):
            raise httpx.RemoteProtocolError(f"a result's body ended at {self.at} of {len(self.buf)} bytes")
        return self.buf


RELEASE_PATH = "/v1/hook/results/release"


def _releases(release: list[str]) -> list[dict]:
    """The release calls' bodies for `release`, at most MAX_RELEASE handles each."""
    return [{"handles": release[at:at + MAX_RELEASE]} for at in range(0, len(release), MAX_RELEASE)]


def _released(body: dict, resp: httpx.Response | Exception) -> None:
    # The results are read; the server drops the files after result_ttl_s anyway, so a
    # release that failed is a warning, not the caller's error.
    if isinstance(resp, Exception):
        why = str(resp)
    else:
        got = msgspec.json.decode(resp.content).get("released")
        if got == len(body["handles"]):
            return
        why = f"{got} of {len(body['handles'])} released (another API server process?)"
    warnings.warn(f"vllm-hook: releasing results read from files: {why}; the server keeps the "
                  "rest until result_ttl_s", RuntimeWarning, stacklevel=5)


def _release_now(http: httpx.Client, handles: list[str], counted: bool = True) -> None:
    """Release `handles` through the synchronous `http`, a failed call a warning (`_released`);
    `counted=False`: some may be released already, so fewer released is no warning."""
    for body in _releases(handles):
        try:
            resp = http.post(RELEASE_PATH, **_as_json(body))
            _raise_for(resp)
        except (httpx.HTTPError, ServerError) as e:
            _released(body, e)
            continue
        if counted:
            _released(body, resp)


def _loopback(url: httpx.URL) -> bool:
    """Whether `url` names this host's loopback interface (where `local_results=None` asks
    for files: a client elsewhere could not open them, and they cost the server a write)."""
    host = url.host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _fetch_path(handle: str) -> str:
    """A retained result, fetched and deleted on the server in one round trip."""
    return f"/v1/hook/results/{handle}?delete=true"


def _from_choice(entry: dict, choices: dict) -> Results:
    """A "tokens" entry's Results: nothing but tokens and errors, the tokens those its choice
    in the response carries (the server sent no safetensors for them)."""
    errors = list(entry.get("errors") or [])
    prompt, gen = choices.get(entry["index"], (None, None))
    if prompt is None or gen is None:
        prompt, gen = prompt or [], gen or []
        errors.append(f"the response carries no token ids for choice {entry['index']}")
    meta = entry.get("meta") or {}
    return Results(request_id=meta.get("request_id", ""), prompt_len=len(prompt), token_ids=[*prompt, *gen],
                   index=meta.get("index", 0), model=meta.get("model", ""), errors=errors)


def _choices_for(entries: list[dict], response: Any) -> dict:
    """`shown_tokens(response)` where an entry needs them."""
    return shown_tokens(response) if any(e.get("format") == TOKENS or e.get("tokens") == CHOICE
                                         for e in entries) else {}


def _decode(entry: dict, data: bytes | memoryview | None, choices: dict) -> Results:
    """One entry's Results: its safetensors `data`, or (a "tokens" entry) its choice's tokens
    (`shown_tokens` of the response)."""
    if entry.get("format") == TOKENS:
        return _from_choice(entry, choices)
    if data is None:
        return Results(request_id="", prompt_len=0, token_ids=[], index=entry.get("index", 0),
                       errors=list(entry.get("errors") or ["no result data"]))
    r = Results.from_bytes(data)
    for e in entry.get("errors") or []:
        if e not in r.errors:
            r.errors.append(e)
    if entry.get("tokens") == CHOICE:          # tokenless safetensors: the choice's tokens
        prompt, gen = choices.get(entry["index"], (None, None))
        if prompt is None or gen is None or len(prompt) != r.prompt_len:
            r.errors.append(f"the response carries no token ids for choice {entry['index']}")
        else:
            r.token_ids = [*prompt, *gen]
    return r


def _generation(body: dict, pairs: list[tuple[int, Results]], chat: bool) -> Generation:
    by_index = dict(pairs)      # entry index = the response's choice index
    choices = []
    for c in body.get("choices", []):
        text = ((c.get("message") or {}).get("content") or "") if chat else c.get("text", "")
        choices.append(Choice(index=c["index"], text=text, token_ids=c.get("token_ids"),
                              prompt_token_ids=c.get("prompt_token_ids", body.get("prompt_token_ids")),
                              finish_reason=c.get("finish_reason"), results=by_index.get(c["index"])))
    return Generation(id=body.get("id", ""), choices=choices, usage=body.get("usage") or {}, raw=body)


@dataclass
class Stream:
    """A streamed completion: iterate (or `async for`) for the text deltas of choice 0; once
    the stream has ended, `text` and `results` (choice 0's). Nothing else is kept per event."""

    _source: Any
    chat: bool
    text: str = ""
    results: Results | None = None
    _hook_event: dict | None = None

    def _take(self, event: dict) -> str | None:
        """The text delta of choice 0 in `event`, or None (the results event is kept)."""
        if event.get("object") == "vllm_hook.results" or hook_field(event) is not None:
            self._hook_event = event
            return None
        for c in event.get("choices") or []:
            if c.get("index", 0) == 0:
                piece = ((c.get("delta") or {}).get("content") if self.chat else c.get("text")) or ""
                self.text += piece
                return piece or None
        return None

    def __iter__(self):
        for event in self._source:
            piece = self._take(event)
            if piece is not None:
                yield piece

    async def __aiter__(self):
        async for event in self._source:
            piece = self._take(event)
            if piece is not None:
                yield piece


def _sse(line: str) -> dict | None:
    """One server-sent event line as JSON; None for blank lines, comments and [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return None if data in ("", "[DONE]") else json.loads(data)


def _hooks_body(hooks: Sequence[Any]) -> dict:
    return {"hooks": [wire_hook(h) for h in hooks]}


def _inline(entry: dict) -> bytes | None:
    """A result entry's inline bytes (None: none, or by handle). SIMD base64: 15 KB in 2 µs,
    the standard library's 56 µs."""
    return pybase64.b64decode(entry["data"]) if entry.get("data") else None


def _collected(body: dict) -> dict[str, list[dict]]:
    data = body.get("data")
    return decode_collected(pybase64.b64decode(data)) if data else {}


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---- the clients ---------------------------------------------------------------------------

class _Core:
    """What `Client` and `AsyncClient` share beyond the module's functions."""

    local_results: bool
    _http: Any

    def _local(self, local_results: bool | None) -> bool:
        return _loopback(self._http.base_url) if local_results is None else bool(local_results)

    def _completion(self, body: dict) -> dict:
        """httpx arguments of a completion or chat request (`_as_json`)."""
        return _as_json(body, tokens=True, local=self.local_results)


class Client(_Core):
    """Synchronous client. `base_url` with or without `/v1`; `model` defaults to the first
    served model. `local_results`: results too large to inline are read from their files
    (the server's `local_results`, in its `result_spill_dir`) where this process can open them,
    then released, and fetched by handle otherwise; asked for with True, never with False, and
    by default (None) where `base_url` is this host's loopback address."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 model: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 http: httpx.Client | None = None, local_results: bool | None = None):
        self.model = model
        self._http = http or httpx.Client(base_url=_base_url(base_url), headers=_headers(api_key),
                                          timeout=timeout)
        self.local_results = self._local(local_results)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def release_pending(self) -> None:
        """Nothing to wait for: this client releases a response's results read from their
        files before returning them (`AsyncClient` does it in the background)."""

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        resp = self._http.request(method, path, **kw)
        _raise_for(resp)
        return resp

    def _model(self) -> str:
        if self.model is None:
            self.model = self._call("GET", "/v1/models").json()["data"][0]["id"]
        return self.model

    def generate(self, prompt: str | Sequence[int], spec: Any = None, **sampling) -> Generation:
        """`/v1/completions`. `prompt` is text or token ids; `sampling` are OpenAI/vLLM fields
        (max_tokens, temperature, n, seed, ...)."""
        body = _body({"model": self._model(), "prompt": prompt}, spec, sampling)
        data = _loads(self._call("POST", "/v1/completions", **self._completion(body)))
        return _generation(data, self._pairs(data), chat=False)

    def chat(self, messages: list[dict], spec: Any = None, **sampling) -> Generation:
        """`/v1/chat/completions`."""
        body = _body({"model": self._model(), "messages": messages}, spec, sampling)
        data = _loads(self._call("POST", "/v1/chat/completions", **self._completion(body)))
        return _generation(data, self._pairs(data), chat=True)

    def stream(self, prompt: str | Sequence[int], spec: Any = None, **sampling) -> Stream:
        """`/v1/completions` streamed: `for delta in client.stream(...)`, then `.results`."""
        body = _body({"model": self._model(), "prompt": prompt, "stream": True}, spec, sampling)
        return self._stream("/v1/completions", body, chat=False)

    def stream_chat(self, messages: list[dict], spec: Any = None, **sampling) -> Stream:
        """`/v1/chat/completions` streamed."""
        body = _body({"model": self._model(), "messages": messages, "stream": True}, spec, sampling)
        return self._stream("/v1/chat/completions", body, chat=True)

    def _stream(self, path: str, body: dict, chat: bool) -> Stream:
        out = Stream(None, chat)

        def events():
            with self._http.stream("POST", path, **self._completion(body)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _raise_for(resp)
                for line in resp.iter_lines():
                    event = _sse(line)
                    if event is not None:
                        yield event
            if out._hook_event is not None:
                out.results = dict(self._pairs(out._hook_event)).get(0)

        out._source = events()
        return out

    def results_of(self, response: Any) -> list[Results]:
        """The results in a response (dict, `openai` object or the extra stream event), in
        choice order; fetched by handle where needed, and then deleted on the server."""
        return [r for _, r in self._pairs(response)]

    def _pairs(self, response: Any) -> list[tuple[int, Results]]:
        entries = _entries(response)
        datas, fetch, release = _plan(entries, self.local_results)
        _release_now(self._http, release)   # first: a fetch that fails must not keep them
        for i in fetch:
            datas[i] = self._fetch(entries[i]["handle"])
        choices = _choices_for(entries, response)
        return [(e["index"], _decode(e, d, choices)) for e, d in zip(entries, datas)]

    def _fetch(self, handle: str) -> bytes | memoryview:
        """A result kept by handle, fetched and deleted (`_Body`)."""
        with self._http.stream("GET", _fetch_path(handle)) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            body = _Body(resp)
            if body.buf is None:
                return resp.read()
            for chunk in resp.iter_raw():
                body.add(chunk)
            return body.done()

    def register_vectors(self, vectors: Mapping[str, Any]) -> list[str]:
        """Store named steering vectors on the server; specs may then name them."""
        body = {k: _wire_vector(v) for k, v in vectors.items()}
        return self._call("POST", "/v1/hook/vectors", **_as_json(body)).json()["vectors"]

    def delete_vectors(self, names: Sequence[str]) -> list[str]:
        left = None
        for n in [names] if isinstance(names, str) else names:
            left = self._call("DELETE", f"/v1/hook/vectors/{n}").json()["vectors"]
        return left if left is not None else self.list_vectors()

    def list_vectors(self) -> list[str]:
        return self._call("GET", "/v1/hook/vectors").json()["vectors"]

    def health(self) -> dict:
        return self._call("GET", "/v1/hook/health").json()

    def register_hooks(self, hooks: Sequence[Any]) -> int:
        """Persistent hooks for every request (operator hooks by name; Python `Hook`s only
        where the server allows client code). Returns how many are registered."""
        return self._call("POST", "/v1/hook/hooks/register", **_as_json(_hooks_body(hooks))).json()["registered"]

    def collect_hook_results(self) -> dict[str, list[dict]]:
        return _collected(self._call("GET", "/v1/hook/hooks/collect").json())

    def clear_hook_results(self) -> int:
        return self._call("POST", "/v1/hook/hooks/clear_results").json()["cleared"]

    def clear_hooks(self) -> None:
        self._call("POST", "/v1/hook/hooks/clear")

    def prefetch_params(self, names: Sequence[str]) -> list[str]:
        return self._call("POST", "/v1/hook/hooks/prefetch", **_as_json({"names": list(names)})).json()["cached"]


class AsyncClient(_Core):
    """The same API as `Client`, as coroutines (httpx.AsyncClient)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 model: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 http: httpx.AsyncClient | None = None, local_results: bool | None = None):
        self.model = model
        self._http = http or httpx.AsyncClient(base_url=_base_url(base_url), headers=_headers(api_key),
                                               timeout=timeout, limits=ASYNC_LIMITS)
        self.local_results = self._local(local_results)
        self._to_release: list[str] = []          # handles of results read from files, not yet released
        self._unanswered: list[dict] = []         # release calls sent or to send, not answered yet
        self._releasing: asyncio.Task | None = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        try:
            await self.release_pending()
        finally:
            await self._http.aclose()

    async def release_pending(self) -> None:
        """Wait until every result read from its file so far is released on the server (they
        are released in the background: `_release_soon`; `aclose` waits for it too)."""
        task = self._releasing
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            await asyncio.shield(task)

    def _release_soon(self, handles: list[str]) -> None:
        """Release `handles` (results read from their files) in the background, in one call
        with those of every response read meanwhile, one call in flight at a time. Not a
        round trip before each response's results are returned: a served batch's responses
        all arrive at its last step, and a release each held each one back by a round trip
        through the busy server (and took 2 ms of this process's CPU a response on the CI
        machine: `benchmarks/served_delivery.py --per-response 1`). If the event loop ends
        first (`asyncio.run` returned with the client open), what is left is released then,
        blocking (`_release_left`)."""
        self._to_release.extend(handles)
        loop = asyncio.get_running_loop()
        task = self._releasing
        # (a task of another loop: one closed without cancelling it never runs again)
        if task is None or task.done() or task.get_loop() is not loop:
            task = loop.create_task(self._release_queued())
            task.add_done_callback(self._release_left)
            self._releasing = task

    async def _release_queued(self) -> None:
        await asyncio.sleep(0)      # the responses read in this turn of the loop go in one call
        while self._to_release:
            self._unanswered, self._to_release = _releases(self._to_release), []
            while self._unanswered:
                body = self._unanswered[0]
                try:
                    got: Any = await self._call("POST", RELEASE_PATH, **_as_json(body))
                except Exception as e:      # a warning: the server drops them after result_ttl_s
                    got = e
                self._unanswered.pop(0)
                try:
                    _released(body, got)
                except Exception:           # warnings made errors: nobody awaits this task for them
                    pass

    def _release_left(self, task: asyncio.Task) -> None:
        """The release task's end: cancelled (its event loop ending, or before its first step),
        what it had not had answered is released now, blocking (a handle released twice is
        not counted twice); the server would otherwise keep the files until result_ttl_s."""
        if not task.cancelled():
            return
        left = [h for body in self._unanswered for h in body["handles"]] + self._to_release
        self._unanswered, self._to_release = [], []
        if not left:
            return
        try:
            with httpx.Client(base_url=self._http.base_url, headers=self._http.headers, auth=self._http.auth,
                              timeout=5) as http:
                _release_now(http, left, counted=False)
        except Exception as e:
            warnings.warn(f"vllm-hook: releasing results read from files as the event loop ended: {e}; the "
                          "server keeps them until result_ttl_s", RuntimeWarning, stacklevel=2)

    async def _call(self, method: str, path: str, **kw) -> httpx.Response:
        resp = await self._http.request(method, path, **kw)
        _raise_for(resp)
        return resp

    async def _model(self) -> str:
        if self.model is None:
            self.model = (await self._call("GET", "/v1/models")).json()["data"][0]["id"]
        return self.model

    async def generate(self, prompt: str | Sequence[int], spec: Any = None, **sampling) -> Generation:
        body = _body({"model": await self._model(), "prompt": prompt}, spec, sampling)
        data = _loads(await self._call("POST", "/v1/completions", **self._completion(body)))
        return _generation(data, await self._pairs(data), chat=False)

    async def chat(self, messages: list[dict], spec: Any = None, **sampling) -> Generation:
        body = _body({"model": await self._model(), "messages": messages}, spec, sampling)
        data = _loads(await self._call("POST", "/v1/chat/completions", **self._completion(body)))
        return _generation(data, await self._pairs(data), chat=True)

    def stream(self, prompt: str | Sequence[int], spec: Any = None, **sampling) -> Stream:
        """`async for delta in client.stream(...)`, then `.results`."""
        return self._stream("/v1/completions", {"prompt": prompt, "stream": True}, spec, sampling, chat=False)

    def stream_chat(self, messages: list[dict], spec: Any = None, **sampling) -> Stream:
        return self._stream("/v1/chat/completions", {"messages": messages, "stream": True}, spec, sampling,
                            chat=True)

    def _stream(self, path: str, base: dict, spec: Any, sampling: dict, chat: bool) -> Stream:
        out = Stream(None, chat)

        async def events():
            body = _body({"model": await self._model(), **base}, spec, sampling)
            async with self._http.stream("POST", path, **self._completion(body)) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _raise_for(resp)
                async for line in resp.aiter_lines():
                    event = _sse(line)
                    if event is not None:
                        yield event
            if out._hook_event is not None:
                out.results = dict(await self._pairs(out._hook_event)).get(0)

        out._source = events()
        return out

    async def results_of(self, response: Any) -> list[Results]:
        return [r for _, r in await self._pairs(response)]

    async def _fetch(self, handle: str) -> bytes | memoryview:
        """A result kept by handle, fetched and deleted (`_Body`: a large one received into
        reused memory)."""
        async with self._http.stream("GET", _fetch_path(handle)) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            body = _Body(resp)
            if body.buf is None:
                return await resp.aread()
            async for chunk in resp.aiter_raw():
                body.add(chunk)
            return body.done()

    async def _pairs(self, response: Any) -> list[tuple[int, Results]]:
        entries = _entries(response)
        # Only results kept by handle and not read from their files need a round trip (those
        # at once); inline ones are decoded here, without a task each: a batch's responses all
        # arrive at its last step.
        datas, fetch, release = _plan(entries, self.local_results)
        if release:                         # first: a fetch that fails must not keep them
            self._release_soon(release)
        if fetch:
            got = await asyncio.gather(*(self._fetch(entries[i]["handle"]) for i in fetch))
            for i, data in zip(fetch, got):
                datas[i] = data
        choices = _choices_for(entries, response)
        return [(e["index"], _decode(e, d, choices)) for e, d in zip(entries, datas)]

    async def register_vectors(self, vectors: Mapping[str, Any]) -> list[str]:
        body = {k: _wire_vector(v) for k, v in vectors.items()}
        return (await self._call("POST", "/v1/hook/vectors", **_as_json(body))).json()["vectors"]

    async def delete_vectors(self, names: Sequence[str]) -> list[str]:
        left = None
        for n in [names] if isinstance(names, str) else names:
            left = (await self._call("DELETE", f"/v1/hook/vectors/{n}")).json()["vectors"]
        return left if left is not None else await self.list_vectors()

    async def list_vectors(self) -> list[str]:
        return (await self._call("GET", "/v1/hook/vectors")).json()["vectors"]

    async def health(self) -> dict:
        return (await self._call("GET", "/v1/hook/health")).json()

    async def register_hooks(self, hooks: Sequence[Any]) -> int:
        return (await self._call("POST", "/v1/hook/hooks/register", **_as_json(_hooks_body(hooks)))).json()["registered"]

    async def collect_hook_results(self) -> dict[str, list[dict]]:
        return _collected((await self._call("GET", "/v1/hook/hooks/collect")).json())

    async def clear_hook_results(self) -> int:
        return (await self._call("POST", "/v1/hook/hooks/clear_results")).json()["cleared"]

    async def clear_hooks(self) -> None:
        await self._call("POST", "/v1/hook/hooks/clear")

    async def prefetch_params(self, names: Sequence[str]) -> list[str]:
        return (await self._call("POST", "/v1/hook/hooks/prefetch", **_as_json({"names": list(names)}))).json()["cached"]
