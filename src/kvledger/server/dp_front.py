"""The one URL of ``kvledger serve --dp-size N``: SGLang's router for everything, plus sessions.

SGLang's router (``sglang-router`` 0.3.2, and ``smg`` 1.13 after it) does not forward ``/open_session``
or ``/close_session`` (404), and no routing key it honours lets a caller choose the replica: under
``--policy manual`` it assigns a new key to a replica of its own choosing (random, fewest requests or
fewest keys), so a turn keyed by its session id lands on a replica that never opened the session
(checked: 404 ``session_not_found``). This front adds only that. It listens on the public port and

- opens a session on a replica it picks (among those up, the one holding the fewest of this front's
  sessions; the next one if that one's table is full, 429), and remembers which (a client-chosen id
  it already routes goes to its holder, which answers 409);
- sends a session's turns (``/generate`` with ``session_params.id``) and its ``/close_session`` to that
  replica, so every turn meets its KV; a turn for a replica that is down (being restarted by the
  launcher) gets 503 with ``Retry-After`` and the session waits for it;
- sends a session id it does not know to a replica, which answers in the API's own words (404
  ``session_not_found``, or 401 first without the key): the front checks no key itself;
- passes every other request, unread and streamed both ways, to the router, which balances them.

A client that disconnects ends the upstream request too (the replica then aborts it). The sessions'
replica map lives in the launcher's process: if the launcher dies, every replica dies with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import httpx
import uvicorn

from ..errors import error_body

log = logging.getLogger("kvledger.dp")

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

# Headers of one hop only (RFC 9110 7.6.1), and those the relay recomputes.
_HOP = {
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
    b"upgrade", b"host", b"content-length",
}  # fmt: skip
_GONE = object()


class DPFront:
    """An ASGI app: the session-aware front of a router and its replicas.

    ``up[i]`` says whether replica ``i`` is serving; the launcher's thread writes it (a restart) and
    this app's loop reads it."""

    def __init__(
        self, router_url: str, replica_urls: list[str], up: list[bool], max_body_bytes: int, max_sessions: int
    ):
        self.router_url = router_url
        self.replicas = replica_urls
        self.up = up
        self.max_body_bytes = max_body_bytes
        # Session id -> the replica that holds it, least recently used first. The replicas together
        # hold at most ``max_sessions`` x N; past that the oldest entries are sessions they have let go
        # (expired, or dropped for a newer one) without this front seeing it: forgotten here too.
        self.sessions: dict[str, int] = {}
        self.cap = max_sessions * len(replica_urls)
        self._turn = 0  # ties between replicas go round
        self.http: httpx.AsyncClient | None = None

    # -- ASGI ---------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            body = await self._read_body(receive)
            if body is _GONE:
                return
            if body is None:
                await _reply(send, 413, error_body("request body too large", "invalid_request_error"))
                return
            # Answer, unless the client goes away first: then the upstream request is closed too.
            answer = asyncio.ensure_future(self._answer(scope, body, send))
            gone = asyncio.ensure_future(_disconnected(receive))
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            for t in (answer, gone):
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answer

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.http = httpx.AsyncClient(
                    timeout=httpx.Timeout(None, connect=5.0),
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                )
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self.http is not None:
                    await self.http.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _read_body(self, receive: Receive):
        """The whole body; None when it is over the limit, ``_GONE`` when the client left first."""
        parts, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return _GONE
            parts.append(msg.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body_bytes:
                return None
            if not msg.get("more_body"):
                return b"".join(parts)

    # -- routing ------------------------------------------------------------------------------------
    async def _answer(self, scope: Scope, body: bytes, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if method == "POST" and path == "/open_session":
            await self._open(scope, body, send)
            return
        if method == "POST" and path in ("/close_session", "/generate"):
            sid = _session_of(path, body)
            if sid is not None:
                await self._session_request(scope, body, send, sid, closing=path == "/close_session")
                return
            if path == "/close_session":  # not a body naming a session: a replica says what is wrong
                await self._relay(self._any_replica(), scope, body, send)
                return
        await self._relay(self.router_url, scope, body, send)

    def _any_replica(self) -> str:
        return self.replicas[next((i for i, u in enumerate(self.up) if u), 0)]

    def _pick(self) -> list[int]:
        """Replicas to open a session on, best first: up ones, fewest of our sessions, ties in turn."""
        held = [0] * len(self.replicas)
        for i in self.sessions.values():
            held[i] += 1
        n = len(self.replicas)
        self._turn += 1
        order = sorted(range(n), key=lambda i: (held[i], (i - self._turn) % n))
        return [i for i in order if self.up[i]]

    def _remember(self, sid: str, i: int) -> None:
        self.sessions.pop(sid, None)
        self.sessions[sid] = i
        while len(self.sessions) > self.cap:
            del self.sessions[next(iter(self.sessions))]

    async def _open(self, scope: Scope, body: bytes, send: Send) -> None:
        named = _session_of("/open_session", body)
        if named in self.sessions:  # a client-chosen id we route already: its holder answers (409)
            await self._relay(self.replicas[self.sessions[named]], scope, body, send)
            return
        last = None
        for i in self._pick():
            try:
                r = await self._request(self.replicas[i], scope, body)
            except httpx.TransportError:
                continue  # it died since it was marked up: the next one
            if r.status_code == 429:  # its session table is full: another may have room
                last = r
                continue
            if r.status_code == 200:
                try:
                    sid = json.loads(r.content)
                except ValueError:
                    sid = None
                if isinstance(sid, str):
                    self._remember(sid, i)
                    log.info("dp: session %s opened on replica %d", sid, i)
            await _reply_raw(send, r)
            return
        if last is not None:
            await _reply_raw(send, last)
            return
        await _reply(send, 503, error_body("no replica is up to open a session on", "service_unavailable"),
                     retry_after=True)  # fmt: skip

    async def _session_request(self, scope: Scope, body: bytes, send: Send, sid: str, closing: bool) -> None:
        i = self.sessions.get(sid)
        if i is None:  # not opened here: a replica answers (404 session_not_found)
            await self._relay(self._any_replica(), scope, body, send)
            return
        if not self.up[i]:
            await _reply(
                send, 503,
                error_body(f"session {sid!r} is on replica {i}, which is restarting; retry", "service_unavailable"),
                retry_after=True,
            )  # fmt: skip
            return
        if not closing:
            self._remember(sid, i)  # recently used
        status = await self._relay(self.replicas[i], scope, body, send)
        if status == 404 or (closing and status == 200):
            # Closed, or no longer there (expired, or closed on the replica directly): gone here too.
            self.sessions.pop(sid, None)

    # -- HTTP ---------------------------------------------------------------------------------------
    def _build(self, base: str, scope: Scope, body: bytes) -> httpx.Request:
        assert self.http is not None
        url = base + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        return self.http.build_request(scope["method"], url, headers=headers, content=body)

    async def _request(self, base: str, scope: Scope, body: bytes) -> httpx.Response:
        assert self.http is not None
        return await self.http.send(self._build(base, scope, body))

    async def _relay(self, base: str, scope: Scope, body: bytes, send: Send) -> int:
        """Pass the request to ``base`` and its response back as it comes; returns the status."""
        assert self.http is not None
        try:
            r = await self.http.send(self._build(base, scope, body), stream=True)
        except httpx.TransportError as e:
            what = "the router" if base == self.router_url else base
            await _reply(send, 503, error_body(f"{what} is not reachable ({e!r}); retry", "service_unavailable"),
                         retry_after=True)  # fmt: skip
            return 503
        try:
            await send({"type": "http.response.start", "status": r.status_code, "headers": _headers(r)})
            try:
                async for chunk in r.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError as e:
                # The upstream died mid-body: leave the response unfinished, so the client sees it cut.
                log.warning("dp: %s%s broke off mid-response (%r)", base, scope["path"], e)
                return r.status_code
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await r.aclose()
        return r.status_code


def _session_of(path: str, body: bytes) -> str | None:
    """The session a /generate turn, a /close_session or an /open_session names, or None."""
    if path == "/generate" and b"session_params" not in body:
        return None  # the common case, without parsing the body
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    if path in ("/close_session", "/open_session"):
        sid = doc.get("session_id")
    else:
        sp = doc.get("session_params")
        sid = sp.get("id") if isinstance(sp, dict) else None
    return sid if isinstance(sid, str) else None


def _headers(r: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in r.headers.raw if k.lower() not in _HOP]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _reply_raw(send: Send, r: httpx.Response) -> None:
    await send({"type": "http.response.start", "status": r.status_code, "headers": _headers(r)})
    await send({"type": "http.response.body", "body": r.content})


async def _reply(send: Send, status: int, doc: dict, retry_after: bool = False) -> None:
    headers = [(b"content-type", b"application/json")]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(doc).encode()})


class FrontThread:
    """The front served by uvicorn on a thread of the launcher (no signal handlers there: the
    launcher's own handle SIGINT/SIGTERM and stop it)."""

    def __init__(self, app: DPFront, host: str, port: int):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="dp-front", daemon=True)

    def start(self, timeout: float = 30) -> None:
        self.thread.start()
        for _ in range(int(timeout / 0.05)):
            if self.server.started:
                return
            if not self.thread.is_alive():
                break
            time.sleep(0.05)
        raise RuntimeError("the front did not start (is its port free?)")

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 10) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
