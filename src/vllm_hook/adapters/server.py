"""API-server patches (`vllm serve`): result delivery over HTTP, spec errors as HTTP errors,
and the plugin's routes on vLLM's app.

* `AsyncLLM.generate`: when a request with a spec finishes, fetch its captures from the
  workers (one RPC for the requests that finish together, sent as their engine step comes
  back: `frontend.delivery.FetchBatcher`)
  and attach `Results` to the final `RequestOutput`, before the serving code sees it. Works for any AsyncLLM user, not only HTTP.
* `AsyncLLM.add_request`: a spec error leaves it as a SpecError that is also vLLM's
  client-error class, so every endpoint answers 400/404 (not 500).
* `OpenAIServingCompletion.create_completion` / `OpenAIServingChat.create_chat_completion`:
  collect those results per HTTP request and add the `"vllm_hook"` field (non-streaming) or
  one extra SSE event before `data: [DONE]` (streaming); turn spec errors into 400/404.
* `vllm.entrypoints.serve.register_vllm_serve_api_routers`: also attach `/v1/hook/*`, so an
  unmodified `vllm serve` has the routes without naming an endpoint plugin in VLLM_PLUGINS.
* The completion and chat routers' `JSONResponse`: a response with the `"vllm_hook"` field
  has that field rendered by msgspec (`encode.with_field`), the rest as before.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

from ..frontend.delivery import FetchBatcher, delivered, failed, nothing_to_fetch, results_for, with_tokens
from ..frontend.state import FrontendState, maybe_state, state_of
from ..results import ATTR, Results
from ..server import encode
from ..server.errors import check_served_spec, error_body, spec_error_of, status_of
from ..server.store import ResultStore
from ..spec.errors import SpecError, UnknownVectorError
from ..spec.lens import has_lens_args, translate
from ..spec.schema import SPEC_KEY
from .frontend import EARLY, FIRST
from .patching import when_imported, wrap_method

log = logging.getLogger("vllm_hook")
SERVED_ATTR = "_vllm_hook_served"
BATCHER_ATTR = "_vllm_hook_fetcher"

_ENCODER: ThreadPoolExecutor | None = None
# Threads encoding large results: a file-reading client's are written to their files from
# their tensors (`StParts`), writes that release the GIL, so a batch's files are written side
# by side (results kept in memory are serialised holding it, as on one thread); a quarter of
# the CPUs this process may use, at most 4, leaving the rest to vLLM and the event loop.
ENCODE_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 4))


def _encoder() -> ThreadPoolExecutor:
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = ThreadPoolExecutor(max_workers=ENCODE_THREADS, thread_name_prefix="vllm_hook_encode")
    return _ENCODER


@dataclass
class Served:
    """What the API server keeps per engine: the frontend state and the retained results."""

    frontend: FrontendState
    store: ResultStore


def served_of(engine_client: Any) -> Served:
    sv = engine_client.__dict__.get(SERVED_ATTR)
    if sv is None:
        st = state_of(engine_client.input_processor)
        sv = Served(st, ResultStore(st.cfg.max_retained_bytes, st.cfg.result_ttl_s,
                                     local_dir=st.cfg.result_spill_dir if st.cfg.local_results else None))
        engine_client.__dict__[SERVED_ATTR] = sv
    return sv


# ---- AsyncLLM.generate -----------------------------------------------------------------------

class _Tokens:
    """Token ids seen so far. Streaming requests get deltas; `Results` needs all of them."""

    def __init__(self, delta: bool):
        self.delta, self.prompt, self.gen = delta, None, {}

    def add(self, out: Any) -> None:
        # Not copied: vLLM may still extend these lists (cumulative outputs share the
        # detokenizer's), but only a finished output's are read, and the Results copy them.
        if self.prompt is None and out.prompt_token_ids is not None:
            self.prompt = out.prompt_token_ids
        for c in out.outputs:
            if self.delta:
                self.gen.setdefault(c.index, []).extend(c.token_ids)
            else:
                self.gen[c.index] = c.token_ids

    def view(self, out: Any) -> Any:
        outs = [SimpleNamespace(index=i, token_ids=t) for i, t in sorted(self.gen.items())]
        return SimpleNamespace(request_id=out.request_id, prompt_token_ids=self.prompt or [],
                               outputs=outs)


def _batcher(engine: Any, st: FrontendState) -> FetchBatcher:
    b = engine.__dict__.get(BATCHER_ATTR)
    if b is None:
        b = engine.__dict__[BATCHER_ATTR] = FetchBatcher(st, engine.collective_rpc)
        # The requests each engine step finishes are fetched before vLLM turns the step into
        # outputs (`adapters.frontend._process_outputs`), not once their generators ask; those
        # complete at their prompt, as their first token comes back (`FetchBatcher.hold`).
        engine.output_processor.__dict__[EARLY] = lambda ids, last: b.prefetch(ids)
        engine.output_processor.__dict__[FIRST] = b
        st.first_tokens = b.first_tokens
    return b


async def _fetch(engine: Any, request_id: str, view: Any, wire: bool) -> Results | list[Results] | None:
    st = maybe_state(engine.input_processor)
    item = st.pending.get(request_id) if st is not None else None
    if item is None:
        return None
    res = item[1]
    if nothing_to_fetch(st, res):
        st.pop_pending(request_id)
        return results_for(st, view, [], res, wire=wire)
    try:
        entries, opened, ahead = await _batcher(engine, st).entries(res.key)
        # Forgotten only now: if the client goes away during the fetch, the abort that
        # follows still finds the request and discards its results on the workers.
        st.pop_pending(request_id)
        got = with_tokens(ahead, view) if wire else None
        if got is None:
            got = results_for(st, view, entries, res, opened, wire=wire)
        else:
            st.timing["delivered_built_ahead"] += 1
        delivered()
        return got
    except Exception as e:  # the generation succeeded: report, never fail the HTTP request
        st.pop_pending(request_id)
        log.exception("vllm_hook: fetching results of %s failed", request_id)
        return failed(view, f"results could not be fetched from the workers: {e!r}")


async def _noting(agen, st: FrontendState, request_id: str):
    """Passes a request's outputs on; notes its finish for persistent-hook collection."""
    try:
        async for out in agen:
            if out.finished:
                st.note_finished([request_id])
            yield out
    finally:
        await agen.aclose()


async def _delivering(engine, agen, request_id: str, delta: bool, sink, slot):
    tokens = _Tokens(delta)
    try:
        async for out in agen:
            tokens.add(out)
            if out.finished:
                st = maybe_state(engine.input_processor)
                if st is not None and st.persistent_hooks:
                    st.note_finished([request_id])
                # For an HTTP response (a sink) the rows travel in the model's dtype.
                got = await _fetch(engine, request_id, tokens.view(out), wire=sink is not None)
                if got is not None:
                    setattr(out, ATTR, got)
                    if sink is not None:
                        sink.fill(slot, got)
            yield out
    except Exception as e:
        if sink is not None:
            sink.error = e
            if delta and spec_error_of(e) is not None:
                # A streamed HTTP request: the create wrapper answers 400/404 from sink.error.
                # Ending quietly spares vLLM's stream generator from logging a traceback.
                return
        raise
    finally:
        await agen.aclose()


def _generate(orig):
    def generate(self, *args, **kwargs):
        agen = orig(self, *args, **kwargs)
        sp = args[1] if len(args) > 1 else kwargs.get("sampling_params")
        extra = getattr(sp, "extra_args", None)
        if has_lens_args(extra):       # AsyncLLM called directly with vllm-lens-style arguments
            extra = sp.extra_args = translate(extra)[0]
        request_id = str(args[2] if len(args) > 2 else kwargs.get("request_id"))
        if not extra or SPEC_KEY not in extra:
            st = maybe_state(self.input_processor)
            return _noting(agen, st, request_id) if st is not None and st.persistent_hooks else agen
        _batcher(self, state_of(self.input_processor))     # its early fetches from the first
        delta = getattr(getattr(sp, "output_kind", None), "name", "") == "DELTA"
        sink = encode.current()      # read now: the caller's context, not the consumer's
        slot = sink.reserve() if sink is not None else None
        return _delivering(self, agen, request_id, delta, sink, slot)
    return generate


_FLAVOURED: dict[tuple[type, type], type] = {}


def _vllm_flavoured(err: SpecError) -> SpecError:
    """The same error, also an instance of vLLM's client-error class. generate() passes those
    through (0.32 turns other exceptions into a 500), and vLLM's handlers answer 400/404 on
    every endpoint; callers catching SpecError still catch it."""
    from vllm import exceptions as vexc

    base = vexc.VLLMNotFoundError if isinstance(err, UnknownVectorError) else vexc.VLLMValidationError
    cls = _FLAVOURED.get((type(err), base))
    if cls is None:
        cls = type(type(err).__name__, (type(err), base), {"__init__": _flavoured_init,
                                                           "__module__": type(err).__module__})
        _FLAVOURED[(type(err), base)] = cls
    return cls(err)


def _flavoured_init(self, err: SpecError) -> None:
    Exception.__init__(self, str(err))
    self.where, self.problem, self.fix = err.where, err.problem, err.fix
    self.parameter, self.value = None, None      # what vLLM's error mapping reads


def _add_request(orig):
    async def add_request(self, request_id, *args, **kwargs):
        try:
            return await orig(self, request_id, *args, **kwargs)
        except Exception as e:
            # Admitted but not added (vLLM refused it later): leave no pending record.
            st = maybe_state(self.input_processor)
            if st is not None:
                st.pop_pending(str(request_id))
            if not isinstance(e, SpecError) or type(e) in _FLAVOURED.values():
                raise
            raise _vllm_flavoured(e) from e
    return add_request


# ---- OpenAI serving classes -------------------------------------------------------------------

def _error(serving: Any, err: SpecError):
    status, err_type = status_of(err)
    return serving.create_error_response(str(err), err_type=err_type, status_code=HTTPStatus(status))


def _accepted(raw_request: Any) -> frozenset[bytes]:
    """What the HTTP client says it reads (`encode.ACCEPT_HEADER`, a comma-separated list:
    "tokens", "stacked", "tokenless", "local"; every such header, any case); empty without one."""
    # The ASGI scope's raw headers (lower-case names): starlette's Headers.get walks them
    # through Mapping's generic get, several µs a request.
    scope = getattr(raw_request, "scope", None)
    got = [value for name, value in ((scope.get("headers") or ()) if isinstance(scope, dict) else ())
           if name == _ACCEPT]
    if not got:
        return _NONE
    return frozenset(part.strip().lower() for value in got for part in value.split(b","))


_ACCEPT, _NONE = encode.ACCEPT_HEADER.encode("latin-1"), frozenset()
_TOKENS, _STACKED = encode.TOKENS.encode("latin-1"), encode.STACKED.encode("latin-1")
_TOKENLESS = encode.TOKENLESS.encode("latin-1")
_LOCAL = encode.LOCAL.encode("latin-1")


async def _encode(serving: Any, sink: encode.Sink, response: Any = None, stacked: bool = False,
                  tokenless: bool = False, local: bool = False) -> dict:
    """The `"vllm_hook"` field; `response`: the non-streamed response whose choices show
    their tokens, for a client that reads "tokens" entries (else None); `stacked`: the client
    reads stacked sites; `tokenless`: tokenless safetensors; `local`: files it reads itself."""
    sv = served_of(serving.engine_client)
    # Serialising large captures is CPU work: off the event loop, on threads of our own (a
    # batch's large results queued in the default pool held back vLLM's own work there;
    # `ENCODE_THREADS`). Small ones stay on the loop: the hop to a thread and back waits for
    # the GIL (up to its 5 ms switch interval) while the loop runs, more than the encoding
    # itself.
    t0 = time.perf_counter()
    # (a response whose results all carry rows has no "tokens" entry: its choices not read)
    shown = (encode.shown_tokens(response) if response is not None and (tokenless or encode.any_tokens_only(sink))
             else None)
    if encode.nbytes(sink) < encode.ON_LOOP_BELOW:
        body = encode.payload(sink, sv.store, sv.frontend.cfg, shown, stacked, tokenless, local)
    else:
        body = await asyncio.get_running_loop().run_in_executor(_encoder(), functools.partial(
            encode.payload, sink, sv.store, sv.frontend.cfg, shown, stacked, tokenless, local, threaded=True))
    sv.frontend.timing["encode_s"] += time.perf_counter() - t0
    return body


async def _gone(raw_request: Any) -> bool:
    try:
        return raw_request is not None and await raw_request.is_disconnected()
    except Exception:  # a transport without disconnect detection: assume the client is there
        return False


async def _relay(serving: Any, first: str | None, stream, sink: encode.Sink, raw_request: Any = None):
    meta: dict = {}
    try:
        if first is not None:
            meta = encode.chunk_meta(first)
            yield first
        async for chunk in stream:
            if encode.is_done(chunk):
                err = spec_error_of(sink.error)
                if err is not None:
                    # Admitted after the stream started (a later prompt of a batch): too late
                    # for an HTTP status, so an error event as vLLM sends them.
                    yield f"data: {json.dumps(error_body(str(err), *status_of(err)))}\n\n"
                if await _gone(raw_request):
                    # uvicorn drops sends to a closed connection silently: results kept by
                    # handle now would wait for a client that left until result_ttl_s.
                    return
                accepted = _accepted(raw_request)
                body = await _encode(serving, sink, stacked=_STACKED in accepted, local=_LOCAL in accepted)
                try:
                    yield encode.stream_chunk(meta, body)
                except BaseException:     # closed at the last event: nobody gets the handles
                    _drop_handles(serving, body)
                    raise
            elif not meta and isinstance(chunk, str) and chunk.startswith("data:"):
                meta = encode.chunk_meta(chunk)
            yield chunk
    finally:
        await stream.aclose()


def _drop_handles(serving: Any, body: dict) -> None:
    store = served_of(serving.engine_client).store
    for e in body.get("results", ()):
        if e.get("handle"):
            store.delete(e["handle"])


async def _streaming(serving: Any, stream, sink: encode.Sink, raw_request: Any = None):
    # Pull the first event now: a spec is admitted when the stream starts, and an invalid one
    # must become an HTTP error, not a 200 stream carrying an error event.
    first, failure = None, None
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        pass
    except Exception as e:
        failure = e
    err = spec_error_of(sink.error)
    if err is not None:
        await stream.aclose()
        return _error(serving, err)
    if failure is not None:
        raise failure
    return _relay(serving, first, stream, sink, raw_request)


def _create(orig):
    async def create(self, request, *args, **kwargs):
        xargs = getattr(request, "vllm_xargs", None) or {}
        if has_lens_args(xargs):
            try:   # vllm-lens-style arguments: folded into our spec, as JSON text
                folded, _ = translate(xargs)
                folded[SPEC_KEY] = json.dumps(folded[SPEC_KEY])
            except SpecError as e:
                return _error(self, e)
            request.vllm_xargs = folded
        raw = (getattr(request, "vllm_xargs", None) or {}).get(SPEC_KEY)
        if raw is None:
            return await orig(self, request, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            check_served_spec(raw)
        except SpecError as e:
            return _error(self, e)
        finally:     # part of the request's admission, as its stage counter reports it
            served_of(self.engine_client).frontend.timing["admit_s"] += time.perf_counter() - t0
        with encode.collecting() as sink:
            try:
                result = await orig(self, request, *args, **kwargs)
            except Exception as e:
                err = spec_error_of(e)
                if err is None:
                    raise
                return _error(self, err)
        if type(result).__name__ == "ErrorResponse":
            return result
        raw_request = args[0] if args else kwargs.get("raw_request")
        if hasattr(result, "model_dump"):
            # vLLM's response models allow extra fields: this one is serialised with the rest
            # (put in their dict directly: pydantic's __setattr__ is a few µs a request).
            accepted = _accepted(raw_request)
            body = await _encode(self, sink, result if _TOKENS in accepted else None, _STACKED in accepted,
                                 _TOKENLESS in accepted, _LOCAL in accepted)
            extra = getattr(result, "__pydantic_extra__", None)
            if isinstance(extra, dict):
                extra[encode.FIELD] = body
            else:
                result.vllm_hook = body
            return result
        return await _streaming(self, result, sink, raw_request)
    return create


# ---- response rendering ------------------------------------------------------------------------

_RENDERING: dict[type, type] = {}
ROUTERS = ("vllm.entrypoints.openai.completion.api_router",
           "vllm.entrypoints.openai.chat_completion.api_router")


def _rendering(base: type) -> type:
    """`base` (starlette's JSONResponse), but a body with the `"vllm_hook"` field has the rest
    rendered by `base` and the field appended by `encode.with_field`: the standard library's
    json, which `base` uses, was the largest single part of a captured request's API-server
    time on a lent GPU host (run 134)."""
    cls = _RENDERING.get(base)
    if cls is None:
        def render(self, content: Any) -> bytes:
            if type(content) is dict and encode.FIELD in content:
                rest = dict(content)
                body = rest.pop(encode.FIELD)
                return encode.with_field(base.render(self, rest), body)
            return base.render(self, content)

        cls = _RENDERING[base] = type(base.__name__, (base,), {
            "render": render, "__vllm_hook__": True, "__module__": __name__})
    return cls


def _patch_router(mod) -> None:
    """The router renders the response model's dump with its module's `JSONResponse`."""
    base = getattr(mod, "JSONResponse", None)
    if not isinstance(base, type):      # correct without it, only slower: said, not raised
        log.warning("vllm_hook: %s has no JSONResponse: hooked responses are rendered by "
                    "vLLM's own encoder (a vLLM version this adapter does not know)", mod.__name__)
    elif not getattr(base, "__vllm_hook__", False):
        mod.JSONResponse = _rendering(base)


# ---- app routes ----------------------------------------------------------------------------------

def _patch_app_builder(mod) -> None:
    orig = mod.register_vllm_serve_api_routers
    if getattr(orig, "__vllm_hook__", False):
        return

    def register_vllm_serve_api_routers(app, *args, **kwargs):
        orig(app, *args, **kwargs)
        from ..server.routes import attach

        attach(app)

    register_vllm_serve_api_routers.__vllm_hook__ = True
    mod.register_vllm_serve_api_routers = register_vllm_serve_api_routers


def _patch_async_llm(mod) -> None:
    wrap_method(mod.AsyncLLM, "generate", _generate)
    wrap_method(mod.AsyncLLM, "add_request", _add_request)


def install() -> None:
    when_imported("vllm.v1.engine.async_llm", _patch_async_llm)
    when_imported("vllm.entrypoints.openai.completion.serving",
                  lambda m: wrap_method(m.OpenAIServingCompletion, "create_completion", _create))
    when_imported("vllm.entrypoints.openai.chat_completion.serving",
                  lambda m: wrap_method(m.OpenAIServingChat, "create_chat_completion", _create))
    when_imported("vllm.entrypoints.serve", _patch_app_builder)
    for name in ROUTERS:
        when_imported(name, _patch_router)
