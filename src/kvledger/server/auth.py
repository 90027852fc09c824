"""Who is calling: the API keys (users) and the admin key (operators), checked by one ASGI middleware.

A caller is a ``Principal``: its role (``admin`` the ``--admin-api-key``, ``user`` one of the
``--api-key`` keys, ``anonymous`` where no key is needed), whether it may use the admin routes, and
its *owner tag*, a keyed hash (HMAC-SHA256 under a server secret, ``KeyRing``) of the key it
presented: what it opens (a session) and runs (a request) is bound to that tag, never to the key,
so neither the key nor anything that reverses to it is kept, journaled or shown.

Rules:
- ``/health``, ``/metrics`` and ``/dashboard`` (a static page without data: it logs in, below) are open.
- Admin paths (the page map, ``/flush_cache``, pausing and continuing generation, updating weights,
  LoRA adapters, the dashboard's login) need the admin key. A user key is never an admin key: with
  ``--api-key`` and no ``--admin-api-key`` they are refused (403) unless ``--admin-open`` opens them to
  every user key on purpose. A server with no key at all is open, admin paths included (local use:
  it binds 127.0.0.1 by default, and ``middleware.CSRFMiddleware`` keeps web pages out).
- Every other path needs one of the user keys (or the admin key) when ``--api-key`` is set.
- Aborting a request needs its owner's key or admin rights (``may_abort``).

A key comes as ``Authorization: Bearer KEY`` or ``x-api-key: KEY``. HTTP Basic is not taken: a
browser resends it by itself on every request to the origin (a cross-site form included). The
dashboard instead logs in once (``POST /dashboard/login`` with the admin key as a bearer token) and
gets a cookie (``DashboardLogins``: HttpOnly, SameSite=Strict) that opens only ``GET /memory/pages``.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie

from fastapi.responses import JSONResponse

from ..errors import error_body

OPEN_PATHS = {"/health", "/metrics", "/dashboard"}
ADMIN_PATHS = {
    "/memory/pages", "/flush_cache", "/dashboard/login",
    "/pause_generation", "/continue_generation", "/update_weights_from_disk",
    "/load_lora_adapter", "/unload_lora_adapter",
}  # fmt: skip
COOKIE_PATHS = {"/memory/pages"}  # what the dashboard's cookie opens, and only with GET

ADMIN, USER, ANONYMOUS, INTERNAL = "admin", "user", "anonymous", "internal"


@dataclass(frozen=True)
class Principal:
    role: str  # ADMIN | USER | ANONYMOUS | INTERNAL
    owner: str  # the owner tag of what it opens and runs (KeyRing.tag), or the role where no key is used
    admin: bool  # may use the admin paths (and abort any request)


NOBODY = Principal(ANONYMOUS, ANONYMOUS, admin=False)
_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("kvledger_principal", default=NOBODY)


def current_principal() -> Principal:
    """The caller of the HTTP request being served (``NOBODY``, with no rights, outside one)."""
    return _principal.get()


def may_abort(caller: Principal, owner: str | None) -> bool:
    """A request may be aborted by its owner (the same key) or by a caller with admin rights."""
    return caller.admin or caller.owner == owner


class KeyRing:
    """The configured keys and the secret of the owner tags.

    ``secret`` outlives the process when ``--session-journal`` keeps it (``SessionJournal.secret``), so
    that a journaled session's tag still names its key after a restart; otherwise it is random."""

    def __init__(self, user_keys: list[str], admin_key: str | None, admin_open: bool, secret: bytes):
        self.user_keys = [k.encode() for k in user_keys]
        self.admin_key = admin_key.encode() if admin_key else None
        self.admin_open = admin_open
        self._secret = secret

    def tag(self, value: bytes) -> str:
        """The keyed hash that stands for ``value`` (a key, a cache salt) wherever it is kept."""
        return hmac.new(self._secret, value, hashlib.sha256).hexdigest()

    @property
    def open(self) -> bool:
        return not self.user_keys and self.admin_key is None

    def owners(self) -> set[str]:
        """Every owner tag a caller of this configuration can have (a journaled session whose tag is
        not among them belongs to a key that no longer exists)."""
        tags = {self.tag(k) for k in self.user_keys}
        if self.admin_key is not None:
            tags.add(self.tag(self.admin_key))
        if not self.user_keys:
            tags.add(ANONYMOUS)
        return tags

    def identify(self, given: bytes) -> Principal | None:
        """The caller presenting ``given`` (b"" for no key); None when a key is needed and this is not one."""
        if self.admin_key is not None and given and hmac.compare_digest(given, self.admin_key):
            return Principal(ADMIN, self.tag(given), admin=True)
        # Compare with every key (no early exit), so the time taken does not tell which one matched.
        matched = [k for k in self.user_keys if given and hmac.compare_digest(given, k)]
        if matched:
            return Principal(USER, self.tag(given), admin=self.admin_open)
        if self.user_keys:
            return None
        return Principal(ANONYMOUS, ANONYMOUS, admin=self.admin_key is None)


class DashboardLogins:
    """The dashboard's cookie: a random token per login, kept only as its SHA-256 with an expiry
    (``ttl_s``), at most ``max_tokens`` (the oldest go first). It opens ``COOKIE_PATHS`` with GET
    and nothing else, so even a cookie sent cross-site could only read the page map."""

    COOKIE = "kvledger_dashboard"

    def __init__(self, ttl_s: float = 8 * 3600, max_tokens: int = 256):
        self.ttl_s, self.max_tokens = ttl_s, max_tokens
        self._tokens: dict[str, float] = {}  # sha256(token) -> expiry (monotonic)

    def issue(self) -> str:
        token = secrets.token_urlsafe(32)
        now = time.monotonic()
        self._tokens = {h: t for h, t in self._tokens.items() if t > now}
        while len(self._tokens) >= self.max_tokens:
            del self._tokens[next(iter(self._tokens))]
        self._tokens[_digest(token)] = now + self.ttl_s
        return token

    def valid(self, token: str) -> bool:
        expiry = self._tokens.get(_digest(token))
        return expiry is not None and expiry > time.monotonic()

    def revoke(self, token: str) -> None:
        self._tokens.pop(_digest(token), None)

    def token_in(self, cookie_header: bytes) -> str | None:
        """The login token in a ``Cookie`` header, or None."""
        try:
            morsel = SimpleCookie(cookie_header.decode("latin-1")).get(self.COOKIE)
        except CookieError:
            return None
        return morsel.value if morsel is not None else None

    def set_cookie(self, token: str, secure: bool) -> str:
        """The ``Set-Cookie`` value of a login (a browser-session cookie, as long as the token lives)."""
        flags = "; Secure" if secure else ""
        return f"{self.COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict{flags}"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The key of ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (b"" if none)."""
    h = dict(headers)
    scheme, _, rest = h.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return rest.strip()
    return h.get(b"x-api-key", b"")


class AuthMiddleware:
    """401 without a valid key where one is needed, 403 for a caller without admin rights on an
    admin path; sets the request's ``Principal`` (``current_principal``)."""

    def __init__(self, app, keys: KeyRing, logins: DashboardLogins):
        self.app, self.keys, self.logins = app, keys, logins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], scope.get("headers") or []
        who = self.keys.identify(presented_key(headers))
        if path in OPEN_PATHS:
            return await self._as(who or NOBODY, scope, receive, send)
        if (who is None or not who.admin) and scope["method"] == "GET" and path in COOKIE_PATHS:
            token = self.logins.token_in(dict(headers).get(b"cookie", b""))
            if token is not None and self.logins.valid(token):
                who = Principal(ADMIN, "dashboard", admin=True)
        if who is None or (path in ADMIN_PATHS and who.role == ANONYMOUS and self.keys.admin_key is not None):
            body = error_body("invalid or missing API key", "authentication_error", code="invalid_api_key")
            return await JSONResponse(body, status_code=401)(scope, receive, send)
        if path in ADMIN_PATHS and not who.admin:
            if self.keys.admin_key is None:
                hint = "this server has no --admin-api-key (--admin-open opens admin paths to user keys)"
            else:
                hint = "a user key is not an admin key"
            body = error_body(f"{path} needs the admin key: {hint}", "permission_error", code="admin_key_required")
            return await JSONResponse(body, status_code=403)(scope, receive, send)
        return await self._as(who, scope, receive, send)

    async def _as(self, who: Principal, scope, receive, send):
        token = _principal.set(who)
        try:
            return await self.app(scope, receive, send)
        finally:
            _principal.reset(token)
