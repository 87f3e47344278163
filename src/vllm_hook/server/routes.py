"""The plugin's HTTP routes under `/v1/hook/` (covered by vLLM's `--api-key` check, which
guards every `/v1` path).

    GET    /v1/hook/health             versions, retained results, worker counters
    GET    /v1/hook/vectors            registered vector names
    POST   /v1/hook/vectors            {name: [floats] | {"b64": ..., "dtype": ...}, ...}
    DELETE /v1/hook/vectors/{name}
    GET    /v1/hook/results/{handle}   safetensors bytes of a result too large to inline
                                       (`?delete=true`: and deleted, one round trip)
    DELETE /v1/hook/results/{handle}
    POST   /v1/hook/results/release    {"handles": [...]}: results a client read from their
                                       files (`"local"` entries), deleted in one round trip
    POST   /v1/hook/hooks/register     {"hooks": [{"name": ..., "args": {...}} | {"pickle": ...}]}
    GET    /v1/hook/hooks/collect      persistent-hook results, base64 safetensors
    POST   /v1/hook/hooks/clear_results
    POST   /v1/hook/hooks/clear
    POST   /v1/hook/hooks/prefetch     {"names": ["lm_head.weight", ...]}
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pybase64
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..config import HookConfig
from ..frontend import hooks as _hooks
from ..frontend.delivery import RPC
from ..frontend.state import SERVED
from ..frontend.vectors import prepare
from ..spec.errors import SpecError
from .errors import error_body, status_of
from .limits import BodyLimit
from .store import MAX_RELEASE

router = APIRouter(prefix="/v1/hook", tags=["vllm_hook"])
ATTACHED = "vllm_hook_routes_attached"


def _fail(message: str, status: int, err_type: str) -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type), status_code=status)


def _served(request: Request):
    from ..adapters.server import served_of

    engine = getattr(request.app.state, "engine_client", None)
    return engine, (served_of(engine) if engine is not None else None)


def _no_engine() -> JSONResponse:
    return _fail("this server has no engine (render-only server)", 503, "ServiceUnavailable")


async def _rpc(engine: Any, *args: Any) -> list:
    return await engine.collective_rpc(RPC, args=args)


@router.get("/health")
async def health(request: Request):
    import vllm

    engine, sv = _served(request)
    if engine is None:
        return _no_engine()
    try:
        workers = await _rpc(engine, "stats")
    except Exception as e:
        workers = [{"error": repr(e)}]
    st = sv.store.stats()
    cfg = sv.frontend.cfg
    return {
        "status": "ok",
        "vllm_hook_version": __version__,
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "model": sv.frontend.info.name,
        "num_layers": sv.frontend.info.num_layers,
        "hidden_size": sv.frontend.info.hidden_size,
        "sites": list(cfg.sites),
        "frontend": sv.frontend.counters(),
        "retained_results": {"count": st.count, "bytes": st.bytes, "max_bytes": st.max_bytes,
                             "ttl_s": st.ttl_s, "dropped": st.dropped, "as_files": st.local,
                             "files_dir": sv.store.local_dir if cfg.local_results else None},
        "pending_requests": len(sv.frontend.pending),
        "held_results": _held(engine),
        "vectors": sorted(sv.frontend.names),
        "hooks": {"layers": sorted(cfg.layers_of(cfg.hook_layers, sv.frontend.info.num_layers)),
                  "operator_hooks": _operator_hooks(cfg),
                  "allow_client_code": cfg.allow_client_code,
                  "persistent": sv.frontend.persistent_hooks},
        "limits": {"max_inline_result_bytes": cfg.max_inline_result_bytes,
                   "max_request_bytes": cfg.max_request_bytes},
        "workers": workers,
    }


def _held(engine) -> int:
    """Results fetched while their requests decode, waiting for their finish (`FetchBatcher`)."""
    from ..adapters.server import BATCHER_ATTR

    b = engine.__dict__.get(BATCHER_ATTR)
    return b.held() if b is not None else 0


def _operator_hooks(cfg: HookConfig) -> dict[str, str]:
    from ..hooks import registry

    registry.load(tuple(cfg.hook_modules))
    return registry.available()


@router.get("/vectors")
async def list_vectors(request: Request):
    engine, sv = _served(request)
    if engine is None:
        return _no_engine()
    return {"vectors": sorted(sv.frontend.names), "hidden_size": sv.frontend.info.hidden_size}


@router.post("/vectors")
async def register_vectors(request: Request):
    engine, sv = _served(request)
    if engine is None:
        return _no_engine()
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else f"not valid JSON: {e}"
        return _fail(f"request body is {why}. Send an object "
                     '{"name": [floats] or {"b64": ..., "dtype": "float32"}}', 400, "BadRequestError")
    if not isinstance(body, dict) or not body:
        return _fail('expected a non-empty JSON object {"name": vector, ...}', 400, "BadRequestError")
    try:
        payload, digests = prepare(sv.frontend, body)
    except RecursionError:
        return _fail("a vector is nested too deeply: send a flat list of floats", 400, "BadRequestError")
    except SpecError as e:
        status, err_type = status_of(e)
        return _fail(str(e), status, err_type)
    await _rpc(engine, "register_vectors", payload)
    sv.frontend.names.update(digests)
    sv.frontend.resolved.clear()
    return {"vectors": sorted(sv.frontend.names)}


@router.delete("/vectors/{name}")
async def delete_vector(name: str, request: Request):
    engine, sv = _served(request)
    if engine is None:
        return _no_engine()
    if name not in sv.frontend.names:
        return _fail(f"no registered vector named {name!r}", 404, "NotFoundError")
    await _rpc(engine, "delete_vectors", [name])
    sv.frontend.names.pop(name, None)
    sv.frontend.resolved.clear()
    return {"deleted": name, "vectors": sorted(sv.frontend.names)}


@router.get("/results/{handle}")
async def get_result(handle: str, request: Request):
    engine, sv = _served(request)
    if engine is None:
        return _no_engine()
    delete = request.query_params.get("delete", "false").lower() in ("1", "true", "yes")
    take = sv.store.pop if delete else sv.store.get
    # A file-backed entry (`local_results`, asked for by a client that then could not open
    # the file) is read off the event loop; one in memory is at hand.
    data = (await asyncio.get_running_loop().run_in_executor(None, take, handle)
            if sv.store.path(handle) else take(handle))
    if data is None:
        return _fail(f"no retained result {handle!r}: unknown, deleted, or older than "
                     f"result_ttl_s={sv.store.ttl_s:g}", 404, "NotFoundError")
    return Response(content=data, media_type="application/octet-stream")


@router.delete("/results/{handle}")
async def delete_result(handle: str, request: Request):
    engine, sv = _served(request)
    if engine is None:
        return _no_engine()
    if not sv.store.delete(handle):
        return _fail(f"no retained result {handle!r}", 404, "NotFoundError")
    return {"deleted": handle}


@router.post("/results/release")
async def release_results(request: Request):
    engine, sv = _served(request)
    if engine is None:
        return _no_engine()
    try:
        body = await _json_body(request)
    except SpecError as e:
        return _spec_failure(e)
    handles = body.get("handles") if isinstance(body, dict) else None
    if not isinstance(handles, list) or not all(isinstance(h, str) for h in handles):
        return _fail('send {"handles": [handle, ...]}: a list of result handles', 400, "BadRequestError")
    if len(handles) > MAX_RELEASE:
        return _fail(f"{len(handles)} handles: at most {MAX_RELEASE} per call", 400, "BadRequestError")
    # Unlinking files frees their pages: off the event loop.
    released = await asyncio.get_running_loop().run_in_executor(None, _release, sv.store, handles)
    return {"released": released}


def _release(store: Any, handles: list[str]) -> int:
    return sum(store.delete(h) for h in handles)


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"{}")
    except (ValueError, RecursionError) as e:
        raise SpecError("body", f"not valid JSON ({type(e).__name__})", "send a JSON object") from None


def _spec_failure(e: SpecError) -> JSONResponse:
    status, err_type = status_of(e)
    return _fail(str(e), status, err_type)


async def _worker_call(engine: Any, *args: Any) -> Any:
    """The first worker's reply of a persistent-hook RPC (503 body when hooks are off)."""
    replies = await _rpc(engine, *args)
    first = replies[0] if replies else None
    if isinstance(first, dict) and "error" in first and len(first) == 1:
        raise SpecError("hooks", first["error"], "restart the engine with hook layers")
    return replies


async def _hooks_route(request: Request, work) -> Any:
    """A persistent-hook route: `work(engine, served)`'s answer, 503 without an engine, a
    SpecError (bad body, hooks off, unknown hook) as its 4xx."""
    engine, sv = _served(request)
    if engine is None:
        return _no_engine()
    try:
        return await work(engine, sv)
    except SpecError as e:
        return _spec_failure(e)


async def _list_field(request: Request, field: str, example: str, kind=dict) -> list:
    body = await _json_body(request)
    got = body.get(field) if isinstance(body, dict) else None
    if not isinstance(got, list) or not all(isinstance(x, kind) for x in got):
        raise SpecError(field, f"expected {{\"{field}\": [...]}}", f"send {example}")
    return got


@router.post("/hooks/register")
async def register_hooks(request: Request):
    async def work(engine, sv):
        hooks = await _list_field(request, "hooks", '{"hooks": [{"name": ..., "args": {...}}]}')
        args = _hooks.register_args(sv.frontend, hooks)
        return {"registered": _hooks.registered(sv.frontend, await _worker_call(engine, *args))}
    return await _hooks_route(request, work)


@router.get("/hooks/collect")
async def collect_hooks(request: Request):
    async def work(engine, sv):
        replies = await _worker_call(engine, *_hooks.collect_args(sv.frontend))
        blob = _hooks.collected_blob(replies)
        return {"format": "safetensors", "data": pybase64.b64encode_as_string(blob) if blob else None}
    return await _hooks_route(request, work)


@router.post("/hooks/clear_results")
async def clear_hook_results(request: Request):
    async def work(engine, sv):
        return {"cleared": int((await _worker_call(engine, "clear_hook_results"))[0])}
    return await _hooks_route(request, work)


@router.post("/hooks/clear")
async def clear_hooks(request: Request):
    async def work(engine, sv):
        await _worker_call(engine, "clear_hooks")
        _hooks.cleared(sv.frontend)
        return {"registered": 0}
    return await _hooks_route(request, work)


@router.post("/hooks/prefetch")
async def prefetch(request: Request):
    async def work(engine, sv):
        names = await _list_field(request, "names", '{"names": ["lm_head.weight"]}', str)
        return {"cached": _hooks.prefetched(await _worker_call(engine, "prefetch_params", names))}
    return await _hooks_route(request, work)


def _config(app: FastAPI) -> HookConfig:
    extra = getattr(getattr(app.state, "args", None), "additional_config", None)
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else None
    return HookConfig.from_additional_config(extra)


def attach(app: FastAPI) -> None:
    """Add the routes and the body-size limit to vLLM's app, once (both the general plugin and
    the endpoint plugin call this)."""
    if getattr(app.state, ATTACHED, False):
        return
    setattr(app.state, ATTACHED, True)
    SERVED["on"] = True        # this process serves HTTP clients: client code needs allow_client_code
    app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=_config(app).max_request_bytes)
