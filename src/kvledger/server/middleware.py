"""ASGI middleware of the front: the body's size and time limits (413, 408) and the cross-site
request guard (403 another site's ``Origin``, 415 a POST body that is not JSON). The keys are
``auth.py``'s.

Pure ASGI (not BaseHTTPMiddleware), so handlers still see client disconnects."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse

from ..errors import ValidationError, error_body

_DEFAULT_PORTS = {"http": 80, "https": 443}


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


def origin_of(value: str) -> tuple[str, str, int] | None:
    """``scheme://host[:port]`` as ``(scheme, host, port)``, the default port filled in; None if it is
    not such an origin (``null``, a path, another scheme)."""
    try:
        u = urlsplit(value)
        port = u.port
    except ValueError:
        return None
    if u.scheme not in _DEFAULT_PORTS or not u.hostname or u.path not in ("", "/") or u.query or u.fragment:
        return None
    if u.username is not None or u.password is not None:
        return None
    return u.scheme, u.hostname.lower(), port if port is not None else _DEFAULT_PORTS[u.scheme]


def parse_origins(values: list[str] | None) -> list[str]:
    """``--allowed-origins`` as a browser serialises an origin (``scheme://host[:port]``, the default
    port left out); a value that is not an origin (``*`` included: list the sites) is refused."""
    out = []
    for v in values or []:
        o = origin_of(v)
        if o is None:
            raise ValidationError(
                f"--allowed-origins: {v!r} is not an origin (scheme://host[:port]; no wildcard)",
                param="allowed_origins",
            )
        scheme, host, port = o
        out.append(f"{scheme}://{host}" + ("" if port == _DEFAULT_PORTS[scheme] else f":{port}"))
    return out


def _same_origin(origin: tuple[str, str, int], host: bytes | None) -> bool:
    """``origin`` is the site this request was sent to (its ``Host`` header)."""
    if not host:
        return False
    target = origin_of(f"{origin[0]}://{host.decode('latin-1')}")
    return target == origin


class CSRFMiddleware:
    """What stops a web page in an operator's browser from driving this server (cross-site request
    forgery): a request with an ``Origin`` header that is neither this server's own (its ``Host``)
    nor in ``allowed`` gets 403 ``cross_origin``; a POST with a body must declare
    ``Content-Type: application/json`` (415 ``unsupported_media_type``), which a cross-site form or a
    ``text/plain`` fetch cannot send without a CORS preflight, which this server never grants (other
    than to ``allowed``). A POST without a body and without a content type (SGLang's router flushing
    its workers' caches) is let through: browsers send ``Origin`` with every POST, so a cross-site one
    stops at the first rule."""

    def __init__(self, app, allowed: list[str]):
        self.app = app
        self.allowed = {origin_of(o) for o in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        origins = [v for k, v in headers if k == b"origin"]
        if origins:
            o = origin_of(origins[0].decode("latin-1")) if len(origins) == 1 else None
            host = dict(headers).get(b"host")
            if o is None or not (o in self.allowed or _same_origin(o, host)):
                body = error_body(
                    "cross-origin request refused: this Origin is not the server's own and not in --allowed-origins",
                    "permission_error", code="cross_origin",
                )  # fmt: skip
                return await JSONResponse(body, status_code=403)(scope, receive, send)
        if scope["method"] == "POST" and not _json_or_empty(headers):
            body = error_body(
                "POST bodies must be JSON: send Content-Type: application/json "
                "(curl: -H 'Content-Type: application/json')",
                "invalid_request_error", code="unsupported_media_type",
            )  # fmt: skip
            return await JSONResponse(body, status_code=415)(scope, receive, send)
        return await self.app(scope, receive, send)


def _json_or_empty(headers: list[tuple[bytes, bytes]]) -> bool:
    types = [v for k, v in headers if k == b"content-type"]
    if not types:
        h = dict(headers)
        return b"transfer-encoding" not in h and h.get(b"content-length", b"0").strip() == b"0"
    media = {t.split(b";", 1)[0].strip().lower() for t in types}
    return media == {b"application/json"}
