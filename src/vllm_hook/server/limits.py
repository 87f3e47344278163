"""Refuse oversized request bodies (HTTP 413) before anything parses them.

Applies to the plugin's routes and to the two routes that accept specs (a spec may carry
inline vectors). With a Content-Length header the check is free; a chunked body is read up
to the limit and then replayed to the app.
"""

from __future__ import annotations

import json

GUARDED = ("/v1/hook/", "/v1/completions", "/v1/chat/completions")


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if not path.startswith(GUARDED):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                too_big = False
            if too_big:
                return await self._refuse(send, int(length))
            return await self.app(scope, receive, send)
        # No length announced: buffer up to the limit, then hand the body on unchanged.
        messages, size = [], 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send, size)
            if not msg.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, send, size: int) -> None:
        body = json.dumps({"error": {
            "message": f"request body of {size} bytes exceeds the vllm_hook limit of "
                       f"{self.max_bytes} bytes; send smaller vectors (register them once with "
                       "POST /v1/hook/vectors and name them) or raise additional_config "
                       "vllm_hook.max_request_bytes",
            "type": "RequestEntityTooLarge", "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
