"""The front's rules of who may call what, without a server: keys and owner tags (``auth.KeyRing``), the
dashboard's login tokens, the cross-site guard's origins and content types, and the key settings."""

from __future__ import annotations

import asyncio

import pytest

from kvledger.config import ServerConfig
from kvledger.errors import ValidationError
from kvledger.server.auth import ADMIN, ANONYMOUS, USER, DashboardLogins, KeyRing, may_abort
from kvledger.server.middleware import CSRFMiddleware, origin_of, parse_origins


def test_keys_principals_and_owner_tags():
    ring = KeyRing(["ka", "kb"], "adm", admin_open=False, secret=b"s" * 32)
    a, b, adm = ring.identify(b"ka"), ring.identify(b"kb"), ring.identify(b"adm")
    assert (a.role, a.admin, b.role, adm.role, adm.admin) == (USER, False, USER, ADMIN, True)
    assert len({a.owner, b.owner, adm.owner}) == 3  # each key its own owner
    assert "ka" not in a.owner and a.owner == KeyRing(["ka"], None, False, b"s" * 32).tag(b"ka")
    assert a.owner != KeyRing(["ka"], None, False, b"t" * 32).tag(b"ka")  # keyed: another secret, another tag
    assert ring.identify(b"") is None and ring.identify(b"wrong") is None
    assert ring.owners() == {a.owner, b.owner, adm.owner}
    assert KeyRing(["ka"], None, admin_open=True, secret=b"s" * 32).identify(b"ka").admin  # --admin-open
    assert not KeyRing(["ka"], None, admin_open=False, secret=b"s" * 32).identify(b"ka").admin
    anon_only_admin = KeyRing([], "adm", False, b"s" * 32).identify(b"")
    assert (anon_only_admin.role, anon_only_admin.admin) == (ANONYMOUS, False)
    open_server = KeyRing([], None, False, b"s" * 32)
    assert open_server.identify(b"whatever").admin and open_server.owners() == {ANONYMOUS}
    assert may_abort(adm, a.owner) and may_abort(a, a.owner) and not may_abort(b, a.owner)


def test_dashboard_tokens_expire_and_are_bounded():
    logins = DashboardLogins(ttl_s=60, max_tokens=2)
    t1, t2, t3 = logins.issue(), logins.issue(), logins.issue()
    assert not logins.valid(t1) and logins.valid(t2) and logins.valid(t3)  # the oldest went first
    assert logins.token_in(f"a=b; {DashboardLogins.COOKIE}={t2}".encode()) == t2
    assert logins.token_in(b"garbage;;==") is None
    logins.revoke(t2)
    assert not logins.valid(t2)
    assert not DashboardLogins(ttl_s=-1).valid(DashboardLogins(ttl_s=-1).issue())
    cookie = logins.set_cookie(t3, secure=True)
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" in cookie


def test_origins():
    assert origin_of("http://127.0.0.1:30000") == ("http", "127.0.0.1", 30000)
    assert origin_of("https://Example.com") == ("https", "example.com", 443)
    for bad in ("null", "*", "file:///x", "http://a.com/path", "http://u:p@a.com", "http://a.com:99999", ""):
        assert origin_of(bad) is None, bad
    assert parse_origins(["https://App.example:443", "http://x.example:8080"]) == [
        "https://app.example", "http://x.example:8080"]  # fmt: skip
    with pytest.raises(ValidationError):
        parse_origins(["*"])


def _status(app, method: str, headers: dict) -> int:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope = {"type": "http", "method": method, "path": "/x",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}  # fmt: skip
    asyncio.run(app(inner)(scope, receive, send))
    return sent[0]["status"]


def test_the_cross_site_guard():
    def guard(inner):
        return CSRFMiddleware(inner, ["http://app.example"])

    host = {"host": "127.0.0.1:30000"}
    json_ = {"content-type": "application/json"}
    assert _status(guard, "POST", {**host, **json_}) == 200
    assert _status(guard, "POST", {**host, "content-type": "Application/JSON; charset=utf-8"}) == 200
    assert _status(guard, "POST", {**host, "content-type": "text/plain", "content-length": "5"}) == 415
    assert _status(guard, "POST", {**host, "content-type": "text/plain"}) == 415  # even without a body
    assert _status(guard, "POST", {**host, "content-length": "5"}) == 415  # a body of no declared type
    assert _status(guard, "POST", {**host, "transfer-encoding": "chunked"}) == 415
    assert _status(guard, "POST", {**host}) == 200  # no body, no type: SGLang's router's /flush_cache
    assert _status(guard, "POST", {**host, "content-length": "0"}) == 200
    assert _status(guard, "POST", {**host, **json_, "origin": "http://127.0.0.1:30000"}) == 200
    assert _status(guard, "POST", {**host, **json_, "origin": "http://app.example"}) == 200
    assert _status(guard, "GET", {**host, "origin": "http://app.example:80"}) == 200
    for bad in ("http://evil.example", "http://127.0.0.1:30001", "null", "http://127.0.0.1:30000/x"):
        assert _status(guard, "POST", {**host, **json_, "origin": bad}) == 403, bad
        assert _status(guard, "GET", {**host, "origin": bad}) == 403, bad
    assert _status(guard, "GET", {"origin": "http://127.0.0.1:30000"}) == 403  # no Host: not provably ours


def test_key_settings():
    ServerConfig(api_key=["a", "b"], admin_api_key="c").check()
    with pytest.raises(ValidationError, match="differ"):
        ServerConfig(api_key=["a", "b"], admin_api_key="b").check()
    with pytest.raises(ValidationError, match="empty"):
        ServerConfig(api_key=[""]).check()
