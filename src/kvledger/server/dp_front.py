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
- sends a stored response's follow-ups (``previous_response_id``), retrieve, delete and cancel to the
  replica that stored it (it asks each replica up for the id), so a conversation continues wherever
  its first turn ran;
- passes the routes the router balances as they are (``ROUTED``: /generate, completions, chat,
  embeddings) to it, streamed both ways. The router parses those bodies into its own types: it
  refuses a JSON null the server reads as "not given" and a body without ``model`` (a 422 in plain
  text, or ``"model": "unknown"`` passed on), so the front hands it the body as the server reads it
  (nulls of the body, its messages and stream options dropped, ``model`` the served model's alias);
  an error of the router's that is not in the API's shape is put into it;
- balances itself, in turn over the replicas up, the routes the router does not serve or mangles
  (``BALANCED``: score, rerank, tokenize, detokenize, the model list, a new response), and sends
  ``/abort_request`` to every replica (the request lives on one of them);
- passes every other request (health, info, /flush_cache: the router's own answers) to the router.

So a body the single server accepts is accepted the same way here (tests/nulls.py walks every field).

A client that disconnects ends the upstream request too (the replica then aborts it). The sessions'
replica map lives in the launcher's process: if the launcher dies, every replica dies with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx

from ..errors import error_body
from .dp_bodies import as_the_server_reads, session_of, stored_response
from .dp_http import (
    GONE,
    Receive,
    Scope,
    Send,
    disconnected,
    from_a_replica,
    is_json,
    read_body,
    reply,
    reply_raw,
    response_headers,
    upstream_request,
)
from .dp_sessions import SessionPlaces

log = logging.getLogger("kvledger.dp")

# The routes SGLang's router (0.3.2) balances faithfully once their bodies are in its types.
ROUTED = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings")
# The routes it answers itself (404, 501), with its own model list, or with a body it changed
# ("model": "unknown" on /v1/rerank): the front balances them over the replicas.
BALANCED = ("/v1/score", "/v1/rerank", "/tokenize", "/detokenize", "/v1/responses", "/v1/models")


class DPFront:
    """An ASGI app: the session-aware front of a router and its replicas.

    ``up[i]`` says whether replica ``i`` is serving; the launcher's thread writes it (a restart) and
    this app's loop reads it."""

    def __init__(
        self, router_url: str, replica_urls: list[str], up: list[bool], max_body_bytes: int, max_sessions: int,
        body_timeout_s: float = 30.0,
    ):  # fmt: skip
        self.router_url = router_url
        self.replicas = replica_urls
        self.up = up
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s  # a body not whole by then: 408 (a stalled client)
        self.sessions = SessionPlaces(len(replica_urls), max_sessions)  # session id -> its replica
        self._turn = 0  # ties between replicas go round
        self.http: httpx.AsyncClient | None = None

    # -- ASGI ---------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            try:
                body = await asyncio.wait_for(read_body(receive, self.max_body_bytes), self.body_timeout_s)
            except TimeoutError:
                msg = f"the request body was not received within {self.body_timeout_s:g} s"
                await reply(send, 408, error_body(msg, "invalid_request_error", code="body_timeout"))
                return
            if body is GONE:
                return
            if body is None:
                await reply(send, 413, error_body("request body too large", "invalid_request_error"))
                return
            # Answer, unless the client goes away first: then the upstream request is closed too.
            answer = asyncio.ensure_future(self._answer(scope, body, send))
            gone = asyncio.ensure_future(disconnected(receive))
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

    # -- routing ------------------------------------------------------------------------------------
    async def _answer(self, scope: Scope, body: bytes, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if method == "POST" and path == "/open_session":
            await self._open(scope, body, send)
            return
        if method == "POST" and path in ("/close_session", "/generate"):
            sid = session_of(path, body)
            if sid is not None:
                await self._session_request(scope, body, send, sid, closing=path == "/close_session")
                return
            if path == "/close_session":  # not a body naming a session: a replica says what is wrong
                await self._relay(self._any_replica(), scope, body, send)
                return
        stored = stored_response(method, path, body)
        if stored is not None:
            await self._relay(await self._holder(scope, stored), scope, body, send)
        elif method == "POST" and path == "/abort_request":
            await self._abort(scope, body, send)
        elif method == "POST" and path in ROUTED:
            routed = as_the_server_reads(body, path != "/generate")
            await self._relay(self.router_url, scope, routed, send, unrouted=body)
        elif path in BALANCED or path.startswith("/v1/models/"):
            await self._relay(self._next_replica(), scope, body, send)
        else:
            await self._relay(self.router_url, scope, body, send)

    def _any_replica(self) -> str:
        return self.replicas[next((i for i, u in enumerate(self.up) if u), 0)]

    def _next_replica(self) -> str:
        """The replicas up, in turn (the routes the front balances itself)."""
        live = [i for i, u in enumerate(self.up) if u] or [0]
        self._turn += 1
        return self.replicas[live[self._turn % len(live)]]

    async def _holder(self, scope: Scope, response_id: str) -> str:
        """The replica that stored ``response_id`` (asked with the client's own headers, so a key it
        may not use finds nothing), or any replica up, which answers 404 in the API's words."""
        probe = {**scope, "method": "GET", "path": f"/v1/responses/{response_id}", "query_string": b""}
        for i, url in enumerate(self.replicas):
            if not self.up[i]:
                continue
            try:
                if (await self._request(url, probe, b"")).status_code == 200:
                    return url
            except httpx.TransportError:
                continue
        return self._any_replica()

    async def _abort(self, scope: Scope, body: bytes, send: Send) -> None:
        """``/abort_request`` on every replica up (the request runs on one): the first success, or
        the first replica's answer when none knew it."""
        answers = []
        for i, url in enumerate(self.replicas):
            if self.up[i]:
                with contextlib.suppress(httpx.TransportError):
                    answers.append(await self._request(url, scope, body))
        if not answers:
            await reply(send, 503, error_body("no replica is up", "service_unavailable"), retry_after=True)
            return
        await reply_raw(send, next((r for r in answers if r.status_code == 200), answers[0]))

    def _pick(self) -> list[int]:
        """Replicas to open a session on, best first: up ones, fewest of our sessions, ties in turn."""
        self._turn += 1
        return self.sessions.pick(self.up, self._turn)

    async def _open(self, scope: Scope, body: bytes, send: Send) -> None:
        named = session_of("/open_session", body)
        if named in self.sessions:  # a client-chosen id we route already: its holder answers (409)
            await self._relay(self.replicas[self.sessions.get(named)], scope, body, send)
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
                    self.sessions.remember(sid, i)
                    log.info("dp: a session opened on replica %d", i)  # (never its id: logs are not private)
            await reply_raw(send, r)
            return
        if last is not None:
            await reply_raw(send, last)
            return
        await reply(send, 503, error_body("no replica is up to open a session on", "service_unavailable"),
                    retry_after=True)  # fmt: skip

    async def _session_request(self, scope: Scope, body: bytes, send: Send, sid: str, closing: bool) -> None:
        i = self.sessions.get(sid)
        if i is None:  # not opened here: a replica answers (404 session_not_found)
            await self._relay(self._any_replica(), scope, body, send)
            return
        if not self.up[i]:
            await reply(
                send, 503,
                error_body(f"session {sid!r} is on replica {i}, which is restarting; retry", "service_unavailable"),
                retry_after=True,
            )  # fmt: skip
            return
        if not closing:
            self.sessions.remember(sid, i)  # recently used
        status = await self._relay(self.replicas[i], scope, body, send)
        if closing and status == 200:
            # Closed: gone here too. Not on a 404: another key naming the session gets one (the
            # session is its owner's), and must not unroute it; a session that expired on its
            # replica stays here until the cap pushes it out.
            self.sessions.forget(sid)

    # -- HTTP ---------------------------------------------------------------------------------------
    def _build(self, base: str, scope: Scope, body: bytes) -> httpx.Request:
        assert self.http is not None  # type narrowing only: None would fail at once on use
        return upstream_request(self.http, base, scope, body)

    async def _request(self, base: str, scope: Scope, body: bytes) -> httpx.Response:
        assert self.http is not None  # type narrowing only: None would fail at once on use
        return await self.http.send(self._build(base, scope, body))

    async def _relay(self, base: str, scope: Scope, body: bytes, send: Send, unrouted: bytes | None = None) -> int:
        """Pass the request to ``base`` and its response back as it comes; returns the status.
        ``unrouted``: the client's own body, sent to a replica instead if the router refuses the
        request itself (its stricter types: an empty message, a temperature over 2), so a body the
        server accepts is answered by a server."""
        assert self.http is not None  # type narrowing only: None would fail at once on use
        try:
            r = await self.http.send(self._build(base, scope, body), stream=True)
        except httpx.TransportError as e:
            what = "the router" if base == self.router_url else base
            await reply(send, 503, error_body(f"{what} is not reachable ({e!r}); retry", "service_unavailable"),
                        retry_after=True)  # fmt: skip
            return 503
        if unrouted is not None and r.status_code >= 400 and not from_a_replica(r):
            await r.aclose()
            return await self._relay(self._next_replica(), scope, unrouted, send)
        if base == self.router_url and r.status_code >= 400 and not is_json(r):
            # The router's own refusal, in plain text: in the API's error shape, as the server answers.
            text = (await r.aread()).decode("utf-8", "replace").strip()[:500]
            await r.aclose()
            kind = "not_found_error" if r.status_code == 404 else "invalid_request_error"
            await reply(send, r.status_code, error_body(text or f"HTTP {r.status_code}", kind))
            return r.status_code
        try:
            await send({"type": "http.response.start", "status": r.status_code, "headers": response_headers(r)})
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
