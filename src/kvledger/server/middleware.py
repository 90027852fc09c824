"""ASGI middleware of the front: the body's size and time limits (413, 408). The keys are ``auth.py``'s.

Pure ASGI (not BaseHTTPMiddleware), so handlers still see client disconnects."""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import JSONResponse

from ..errors import error_body


class _BodyTooLarge(Exception):
    pass


class _BodyTooSlow(Exception):
    pass


class BodyLimitMiddleware:
    """413 for bodies over ``limit`` bytes, declared or streamed; 408 for a body not received whole
    within ``timeout_s`` of its first byte being awaited (a client that sends part of a body and
    stalls holds a connection and a handler otherwise for as long as it likes: slowloris)."""

    def __init__(self, app, limit: int, timeout_s: float | None = None):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

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
        seen, whole, deadline = 0, False, None

        async def counting_receive():
            nonlocal seen, whole, deadline
            if whole or self.timeout_s is None:  # after the body: a wait for the client to leave
                msg = await receive()
            else:
                deadline = deadline or time.monotonic() + self.timeout_s
                try:
                    msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise _BodyTooSlow from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                whole = not msg.get("more_body")
                if seen > self.limit:
                    raise _BodyTooLarge
            return msg

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await too_big(scope, receive, send)
        except _BodyTooSlow:
            body = error_body(f"the request body was not received within {self.timeout_s:g} s", "invalid_request_error",
                              code="body_timeout")  # fmt: skip
            await JSONResponse(body, status_code=408, headers={"Connection": "close"})(scope, receive, send)
