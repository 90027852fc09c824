"""ASGI middleware of the front: the body-size limit (413) and the API key (401).

Pure ASGI (not BaseHTTPMiddleware), so handlers still see client disconnects."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from ..errors import error_body

OPEN_PATHS = {"/health", "/metrics"}  # reachable without the API key


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


class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer KEY`` (or ``x-api-key``) matches; /health and /metrics are open."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        given = auth[7:] if auth.lower().startswith(b"bearer ") else headers.get(b"x-api-key", b"")
        if not hmac.compare_digest(given, self.key):
            body = error_body("invalid or missing API key", "authentication_error", code="invalid_api_key")
            return await JSONResponse(body, status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)
