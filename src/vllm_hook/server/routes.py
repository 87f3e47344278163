"""The plugin's HTTP routes under `/v1/hook/` (covered by vLLM's `--api-key` check, which
guards every `/v1` path).

    GET    /v1/hook/health             versions, retained results, worker counters
    GET    /v1/hook/vectors            registered vector names
    POST   /v1/hook/vectors            {name: [floats] | {"b64": ..., "dtype": ...}, ...}
    DELETE /v1/hook/vectors/{name}
    GET    /v1/hook/results/{handle}   safetensors bytes of a result too large to inline
    DELETE /v1/hook/results/{handle}
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..config import HookConfig
from ..frontend.delivery import RPC
from ..frontend.vectors import prepare
from ..spec.errors import SpecError
from .errors import error_body, status_of
from .limits import BodyLimit

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
        "retained_results": {"count": st.count, "bytes": st.bytes, "max_bytes": st.max_bytes,
                             "ttl_s": st.ttl_s, "dropped": st.dropped},
        "pending_requests": len(sv.frontend.pending),
        "vectors": sorted(sv.frontend.names),
        "limits": {"max_inline_result_bytes": cfg.max_inline_result_bytes,
                   "max_request_bytes": cfg.max_request_bytes},
        "workers": workers,
    }


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
    return {"deleted": name, "vectors": sorted(sv.frontend.names)}


@router.get("/results/{handle}")
async def get_result(handle: str, request: Request):
    engine, sv = _served(request)
    if engine is None:
        return _no_engine()
    data = sv.store.get(handle)
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
    app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=_config(app).max_request_bytes)
