"""Who is calling: the API key (users) and the admin key (operators), checked by one ASGI middleware.

Principals: ``admin`` (the ``--admin-api-key``), ``user`` (the ``--api-key``), ``anonymous`` (no key
configured for that path). The principal of the current HTTP request is kept in a context variable,
so the generation service can record who started each request without every route passing it.

Rules:
- ``/health`` and ``/metrics`` are open.
- Admin paths (the page map, the dashboard, ``/flush_cache``, pausing and continuing generation,
  updating weights) need the admin key when one is
  configured (a valid user key gets 403); otherwise they are guarded like every other path.
- Every other path needs the user key (or the admin key) when ``--api-key`` is set.
- Aborting a request that is not the caller's own needs the admin key (``may_abort``).

A key may come as ``Authorization: Bearer KEY``, ``x-api-key: KEY`` or HTTP Basic (any user name, the
key as password), which is what a browser sends after its login prompt: the dashboard answers 401 with
``WWW-Authenticate: Basic`` so an operator's browser asks for the admin key.
"""

from __future__ import annotations

import base64
import binascii
import contextvars
import hmac

from fastapi.responses import JSONResponse

from ..errors import error_body

OPEN_PATHS = {"/health", "/metrics"}
ADMIN_PATHS = {
    "/dashboard", "/memory/pages", "/flush_cache",
    "/pause_generation", "/continue_generation", "/update_weights_from_disk",
    "/load_lora_adapter", "/unload_lora_adapter",
}  # fmt: skip

ADMIN, USER, ANONYMOUS, INTERNAL = "admin", "user", "anonymous", "internal"
_principal: contextvars.ContextVar[str] = contextvars.ContextVar("kvledger_principal", default=ANONYMOUS)


def current_principal() -> str:
    """The principal of the HTTP request being served (``anonymous`` outside one)."""
    return _principal.get()


def may_abort(caller: str, owner: str | None, admin_key_set: bool) -> bool:
    """Without an admin key everyone who may call may abort anything (SGLang's behaviour); with one,
    only the admin may abort another caller's request."""
    return not admin_key_set or caller in (ADMIN, owner)


def presented_key(headers: dict[bytes, bytes]) -> bytes:
    auth = headers.get(b"authorization", b"")
    scheme, _, rest = auth.partition(b" ")
    if scheme.lower() == b"bearer":
        return rest.strip()
    if scheme.lower() == b"basic":
        try:
            return base64.b64decode(rest.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    return headers.get(b"x-api-key", b"")


class AuthMiddleware:
    """401 without a valid key where one is needed, 403 for a user key on an admin path."""

    def __init__(self, app, user_key: str | None, admin_key: str | None):
        self.app = app
        self.user_key = user_key.encode() if user_key else None
        self.admin_key = admin_key.encode() if admin_key else None

    def _principal(self, given: bytes) -> str | None:
        if self.admin_key and given and hmac.compare_digest(given, self.admin_key):
            return ADMIN
        if self.user_key and given and hmac.compare_digest(given, self.user_key):
            return USER
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        path = scope["path"]
        who = self._principal(presented_key(dict(scope.get("headers") or [])))
        admin_path = path in ADMIN_PATHS and self.admin_key is not None
        needed = self.admin_key if admin_path else self.user_key
        if who is None and needed is not None:
            body = error_body("invalid or missing API key", "authentication_error", code="invalid_api_key")
            headers = {"WWW-Authenticate": 'Basic realm="kvledger admin"'} if path == "/dashboard" else None
            return await JSONResponse(body, status_code=401, headers=headers)(scope, receive, send)
        if admin_path and who != ADMIN:
            body = error_body(f"{path} needs the admin key", "permission_error", code="admin_key_required")
            return await JSONResponse(body, status_code=403)(scope, receive, send)
        token = _principal.set(who or ANONYMOUS)
        try:
            return await self.app(scope, receive, send)
        finally:
            _principal.reset(token)
