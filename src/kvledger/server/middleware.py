"""ASGI middleware of the front: the body-size limit (413). The keys are ``auth.py``'s.

Pure ASGI (not BaseHTTPMiddleware), so handlers still see client disconnects."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from ..errors import error_body


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for bodies over ``limit`` bytes, declared or streamed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        body = error_body(
            f"request body over {self.limit} bytes", "invalid_request_error", code="body_too_large"
        )
        too_big = JSONResponse(body, status_code=413)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big(scope, receive, send)
        seen = 0

        async def counting_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return msg

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await too_big(scope, receive, send)
