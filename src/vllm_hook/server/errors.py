"""How vllm-hook errors look over HTTP: a status code and vLLM's error body shape."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from ..spec.errors import SpecError, UnknownVectorError
from ..spec.schema import HookSpec, parse_spec


def spec_error_of(exc: BaseException | None) -> SpecError | None:
    """The SpecError behind `exc`; vLLM may wrap it (0.32: EngineGenerateError from it)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, SpecError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def status_of(err: SpecError) -> tuple[int, str]:
    if isinstance(err, UnknownVectorError):
        return 404, "NotFoundError"
    return 400, "BadRequestError"


def error_body(message: str, status: int, err_type: str) -> dict[str, Any]:
    """The body vLLM's own errors have, so OpenAI clients parse ours the same way."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


# Digests of spec texts that passed `check_served_spec`, most recent last. Clients send one
# spec text for many requests; its parse (45 µs for 28 steering ops on the CI machine) is done
# again at admission, which finds it in its own cache by content: here a repeat costs a hash.
_PASSED: OrderedDict[bytes, None] = OrderedDict()
PASSED_MAX = 1024


def check_served_spec(raw: Any) -> None:
    """Shape checks that need no engine, plus what HTTP clients may not ask for."""
    # surrogatepass: a JSON "\ud800" escape decodes to a lone surrogate, which parse_spec judges
    key = (hashlib.blake2b(raw.encode("utf-8", "surrogatepass"), digest_size=16).digest()
           if isinstance(raw, str) else None)
    if key is not None and key in _PASSED:
        _PASSED.move_to_end(key)
        return
    spec: HookSpec = parse_spec(raw)
    if spec.save is not None:
        # A client must never choose paths on the server's disk.
        raise SpecError("save", "saving results on the server is not available over HTTP",
                        "remove \"save\"; results come back in the response "
                        "(Results.save writes them on the client)")
    if key is not None:
        _PASSED[key] = None
        if len(_PASSED) > PASSED_MAX:
            _PASSED.popitem(last=False)
