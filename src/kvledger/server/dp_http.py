"""The DP front's HTTP plumbing: the ASGI types, the headers a relay drops, a request's upstream
copy, a response's headers, the answers it writes itself, and the front served by uvicorn on a
thread of the launcher (``FrontThread``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Awaitable, Callable

import httpx
import uvicorn

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
GONE = object()  # ``read_body``: the client left before its body was whole

# Headers of one hop only (RFC 9110 7.6.1), and those the relay recomputes.
_HOP = {
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
    b"upgrade", b"host", b"content-length",
}  # fmt: skip
# Origin is checked by this front (middleware.CSRFMiddleware, dp_launcher): upstream, Host is a
# replica's or the router's address, which a browser's Origin would never match.
_NOT_FORWARDED = _HOP | {b"origin"}


def upstream_request(http: httpx.AsyncClient, base: str, scope: Scope, body: bytes) -> httpx.Request:
    """The client's request, to ``base``: its method, path, query and body, its headers but those
    of one hop and ``Origin``."""
    url = base + scope["path"]
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _NOT_FORWARDED]
    return http.build_request(scope["method"], url, headers=headers, content=body)


def from_a_replica(r: httpx.Response) -> bool:
    """Whether the router passed a replica's answer on (it keeps the replica's headers; uvicorn,
    which serves every replica, names itself) rather than answering itself."""
    return r.headers.get("server") == "uvicorn"


def is_json(r: httpx.Response) -> bool:
    return "json" in r.headers.get("content-type", "")


def response_headers(r: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in r.headers.raw if k.lower() not in _HOP]


async def read_body(receive: Receive, max_bytes: int):
    """The whole body; None when it is over ``max_bytes``, ``GONE`` when the client left first."""
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return GONE
        parts.append(msg.get("body", b""))
        size += len(parts[-1])
        if size > max_bytes:
            return None
        if not msg.get("more_body"):
            return b"".join(parts)


async def disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def reply_raw(send: Send, r: httpx.Response) -> None:
    await send({"type": "http.response.start", "status": r.status_code, "headers": response_headers(r)})
    await send({"type": "http.response.body", "body": r.content})


async def reply(send: Send, status: int, doc: dict, retry_after: bool = False) -> None:
    headers = [(b"content-type", b"application/json")]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(doc).encode()})


class FrontThread:
    """The front served by uvicorn on a thread of the launcher (no signal handlers there: the
    launcher's own handle SIGINT/SIGTERM and stop it)."""

    def __init__(self, app: App, host: str, port: int):
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
