"""A hostile HTTP client (issue 50): seeded attacks on every route of a live server, each checked to
be refused with a 4xx (or the connection closed) in bounded time, never a 5xx, never a hang.

``attacks(rng, ...)`` yields named attacks; each is a function of a ``Target`` (the server's URL, two
tenants' keys, its body limits) that returns what the server did (a status, or None for a closed
connection). The test module runs a few hundred beside a bystander; ``bench/hostile_fuzz.py`` runs
them for minutes, with the PD and TP peers' attacks (tests/fuzz/test_hostile_pd.py, _tp.py).

Attack kinds: random JSON; a valid body with fields replaced by junk (wrong types, huge, deeply
nested, wrongly encoded strings); JSON nested past any parser; a body over the size limit, declared
or streamed without a length; wrongly encoded bodies (UTF-16, invalid UTF-8); wrong or missing
content types; a client that sends part of its body and stalls, or vanishes mid-body or mid-answer;
unknown ids and another tenant's ids (sessions, stored responses, requests); junk paths, methods and
headers.
"""

from __future__ import annotations

import json
import random
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from tests.integration.test_malformed_bodies import BAD_VALUES, VALID

BOUND_S = 10.0  # every answer within this (a stalled body: the server's body timeout plus this)


@dataclass
class Target:
    url: str
    keys: tuple[str, str]  # two tenants' user keys
    max_body_bytes: int
    body_timeout_s: float
    owned: dict[str, list[str]] = field(default_factory=dict)  # tenant A's ids: sessions, responses

    @property
    def host_port(self) -> tuple[str, int]:
        u = urlsplit(self.url)
        return u.hostname or "127.0.0.1", u.port or 80

    def headers(self, tenant: int = 0, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}", "Content-Type": "application/json", **extra}


@dataclass
class Outcome:
    status: int | None  # None: the server closed the connection without an answer
    seconds: float
    ok_2xx: bool = False  # the attack may have sent a valid request by chance
    wrong: str | None = None  # what an attack with an exact expectation found instead (image parts)


Attack = Callable[[Target], Outcome]


def _json_junk(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "float", "str", "bool", "none"] + (["list", "dict"] if depth < 5 else [])
    k = rng.choice(kinds)
    if k == "int":
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64, rng.randint(-10**6, 10**6)])
    if k == "float":
        return rng.choice([0.5, -1e308, 1e308, 1e-320, rng.uniform(-5, 5)])
    if k == "str":
        return rng.choice(["", "x" * rng.randint(1, 5000), "\u0000\ud7ff\uffff", "../" * 50, "%s%n{0}", "é" * 100])
    if k == "bool":
        return rng.random() < 0.5
    if k == "none":
        return None
    if k == "list":
        return [_json_junk(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {rng.choice(["prompt", "text", "messages", "n", "model", "x", "stream"]): _json_junk(rng, depth + 1)
            for _ in range(rng.randint(0, 6))}  # fmt: skip


def _raw(t: Target, head: bytes, body_parts: list[bytes], stall: bool = False, close_early: bool = False) -> Outcome:
    """Send ``head`` then ``body_parts`` over a raw socket, or all but the last and then wait for
    the answer (``stall``: a client that never finishes its body), or close before the last
    (``close_early``); the status the server answered, or None if it closed without one."""
    t0 = time.monotonic()
    with socket.create_connection(t.host_port, timeout=t.body_timeout_s + BOUND_S) as s:
        s.sendall(head)
        for i, part in enumerate(body_parts):
            if i == len(body_parts) - 1:
                if close_early:
                    return Outcome(None, time.monotonic() - t0)
                if stall:
                    break
            try:
                s.sendall(part)
            except OSError:  # the server answered and closed while we were still sending
                break
        try:
            data = s.recv(4096)
        except (TimeoutError, OSError):
            data = b""
    seconds = time.monotonic() - t0
    if not data.startswith(b"HTTP/1.1 "):
        return Outcome(None, seconds)
    return Outcome(int(data[9:12]), seconds)


def _head(t: Target, method: str, path: str, length: int | None, ctype: str = "application/json") -> bytes:
    host, port = t.host_port
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", f"Authorization: Bearer {t.keys[0]}",
             f"Content-Type: {ctype}", "Connection: close"]  # fmt: skip
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _post(t: Target, path: str, tenant: int = 0, ok_2xx: bool = False, **kw) -> Outcome:
    t0 = time.monotonic()
    headers = {**t.headers(tenant), **kw.pop("headers", {})}
    try:
        r = httpx.request(kw.pop("method", "POST"), t.url + path, headers=headers, timeout=BOUND_S * 2, **kw)
    except httpx.RemoteProtocolError:
        return Outcome(None, time.monotonic() - t0)
    return Outcome(r.status_code, time.monotonic() - t0, ok_2xx)


def attacks(rng: random.Random, count: int) -> Iterator[tuple[str, Attack]]:
    """``count`` seeded attacks, every kind in turn (so a short run sees each)."""
    routes = sorted(VALID)
    kinds = [
        "random_json", "mutated", "deep", "oversized_declared", "oversized_streamed", "encoding",
        "content_type", "stalled_body", "vanishing_mid_body", "vanishing_mid_answer", "unknown_id",
        "other_tenant", "junk_path",
    ]  # fmt: skip
    for i in range(count):
        kind = kinds[i % len(kinds)]
        route = rng.choice(routes)
        if kind == "random_json":
            body = json.dumps(_json_junk(rng)).encode()
            # Random JSON may happen to be a valid body ({} opens a session): then 2xx is fine.
            yield kind, lambda t, r=route, b=body: _continued(t, r, _post(t, r, ok_2xx=True, content=b))
        elif kind == "mutated":
            body = json.loads(json.dumps(VALID[route]))
            for _ in range(rng.randint(1, 3)):
                if body:
                    body[rng.choice(list(body))] = rng.choice([*BAD_VALUES, _json_junk(rng)])
            # A mutation may leave a valid body: then 2xx is fine (pausing is continued at once).
            yield kind, lambda t, r=route, b=body: _continued(t, r, _post(t, r, ok_2xx=True, json=b))
        elif kind == "deep":
            depth = rng.choice([1000, 100_000])
            yield kind, lambda t, r=route, d=depth: _post(t, r, content=b"[" * d + b"]" * d)
        elif kind == "oversized_declared":
            yield kind, lambda t, r=route: _raw(t, _head(t, "POST", r, t.max_body_bytes + 1), [b"{" + b" " * 1000])
        elif kind == "oversized_streamed":
            def streamed(t: Target, r: str = route) -> Outcome:
                chunk = b"x" * 65536
                parts = [f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"] * (t.max_body_bytes // len(chunk) + 2)
                return _raw(t, _head(t, "POST", r, None), [*parts, b"0\r\n\r\n"])
            yield kind, streamed
        elif kind == "encoding":
            text = json.dumps(VALID[route], ensure_ascii=False)
            blob = rng.choice([text.encode("utf-16"), text.encode("utf-32"), b'{"prompt": "\xff\xfe\xc3("}',
                               text.replace('"', "\u201c").encode()])  # fmt: skip
            yield kind, lambda t, r=route, b=blob: _post(t, r, content=b)
        elif kind == "content_type":
            ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                "application/xml", ""])  # fmt: skip
            body = json.dumps(VALID[route]).encode()
            yield kind, lambda t, r=route, c=ctype, b=body: _continued(
                t, r, _post(t, r, content=b, headers={"Content-Type": c})
            )
        elif kind == "stalled_body":
            body = json.dumps(VALID[route]).encode()
            yield kind, lambda t, r=route, b=body: _raw(
                t, _head(t, "POST", r, len(b)), [b[: len(b) // 2], b[len(b) // 2 :]], stall=True
            )
        elif kind == "vanishing_mid_body":
            body = json.dumps(VALID[route]).encode()
            yield kind, lambda t, r=route, b=body: _raw(
                t, _head(t, "POST", r, len(b)), [b[:3], b[3:]], close_early=True
            )
        elif kind == "vanishing_mid_answer":
            yield kind, _vanish_mid_answer
        elif kind == "unknown_id":
            yield kind, _unknown_id(rng)
        elif kind == "other_tenant":
            yield kind, _other_tenant(rng)
        else:
            path = rng.choice(["/" + "a" * 10000, "/v1/../../etc/passwd", "/v1/models/%00", "/%ff%fe",
                               "/generate?x=" + "%" * 3000, "/v1/responses/" + "r" * 5000])  # fmt: skip
            method = rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
            yield kind, lambda t, p=path, m=method: _post(t, p, method=m, content=b"{}")


def _continued(t: Target, route: str, out: Outcome) -> Outcome:
    """A pause that a random body happened to make valid is undone at once (the bystander runs on)."""
    if route == "/pause_generation" and out.status == 200:
        httpx.post(t.url + "/continue_generation", headers=t.headers(), timeout=BOUND_S)
    return out


def _vanish_mid_answer(t: Target) -> Outcome:
    """A long stream whose client leaves after its first event: the server aborts it (the books,
    checked at the end, say whether its KV came back)."""
    t0 = time.monotonic()
    body = {"text": "vanish", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", t.url + "/generate", json=body, headers=t.headers(), timeout=BOUND_S) as r:
        status = r.status_code
        next(r.iter_lines(), None)
    return Outcome(status, time.monotonic() - t0, ok_2xx=True)


def _unknown_id(rng: random.Random) -> Attack:
    sid, rid = uuid.UUID(int=rng.getrandbits(128)).hex, f"resp_{rng.getrandbits(64):x}"
    calls = [
        ("/generate", {"text": "x", "session_params": {"id": sid}}, "POST"),
        ("/close_session", {"session_id": sid}, "POST"),
        (f"/v1/responses/{rid}", None, "GET"),
        (f"/v1/responses/{rid}", None, "DELETE"),
        (f"/v1/responses/{rid}/cancel", None, "POST"),
        ("/v1/responses", {"input": "x", "previous_response_id": rid, "max_output_tokens": 1}, "POST"),
        ("/abort_request", {"rid": sid}, "POST"),
    ]
    path, body, method = rng.choice(calls)
    return lambda t: _post(t, path, method=method, json=body)


def _other_tenant(rng: random.Random) -> Attack:
    """Tenant B names one of tenant A's live ids: a 404, as if it did not exist."""
    which = rng.choice(["session_turn", "session_close", "response_get", "response_delete", "response_follow_up"])

    def attack(t: Target) -> Outcome:
        if which.startswith("session"):
            sid = rng.choice(t.owned["sessions"])
            if which == "session_turn":
                return _post(t, "/generate", tenant=1, json={"text": "x", "session_params": {"id": sid}})
            return _post(t, "/close_session", tenant=1, json={"session_id": sid})
        rid = rng.choice(t.owned["responses"])
        if which == "response_get":
            return _post(t, f"/v1/responses/{rid}", tenant=1, method="GET")
        if which == "response_delete":
            return _post(t, f"/v1/responses/{rid}", tenant=1, method="DELETE")
        return _post(t, "/v1/responses", tenant=1,
                     json={"input": "x", "previous_response_id": rid, "max_output_tokens": 1})  # fmt: skip

    return attack


def own_things(t: Target) -> None:
    """Tenant A opens two sessions and stores two responses for the other-tenant attacks."""
    t.owned = {"sessions": [], "responses": []}
    for _ in range(2):
        r = httpx.post(t.url + "/open_session", headers=t.headers(), json={}, timeout=BOUND_S)
        r.raise_for_status()
        t.owned["sessions"].append(r.json())
        r = httpx.post(t.url + "/v1/responses", headers=t.headers(), timeout=BOUND_S * 3,
                       json={"input": "a secret of tenant A", "max_output_tokens": 2})  # fmt: skip
        r.raise_for_status()
        t.owned["responses"].append(r.json()["id"])


# -- bad image parts (a vision-language server: issue 52) ----------------------------------------------
IMAGE_KINDS = ("corrupt", "truncated", "bomb", "bad_base64", "remote_off", "too_many", "unsupported", "junk_url")


def _png(img) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def bad_image_url(kind: str, rng: random.Random) -> str | object:
    """One bad image of ``kind`` as an image part's URL (``too_many`` is a good one sent once too often)."""
    import base64
    import io

    from PIL import Image

    from tests.helpers import tiny_image

    good = _png(tiny_image(rng.randint(0, 10**6)))
    b64 = lambda b: "data:image/png;base64," + base64.b64encode(b).decode()  # noqa: E731
    if kind == "corrupt":
        return b64(b"\x89PNG\r\n\x1a\n" + rng.randbytes(rng.randint(0, 2000)))
    if kind == "truncated":
        return b64(good[: rng.randint(8, len(good) - 20)])
    if kind == "bomb":
        buf = io.BytesIO()
        Image.new("1", (rng.choice([6000, 20000]), 6000)).save(buf, format="PNG")
        return b64(buf.getvalue())
    if kind == "bad_base64":
        return "data:image/png;base64," + rng.choice(["!!!", "a", "=" * 7, "AAAA" * 3 + "$", "\u00e9" * 10])
    if kind == "remote_off":
        return rng.choice(["https://example.com/cat.png", "http://127.0.0.1:9/x.png", "http://169.254.169.254/latest",
                           "http://[::1]/a.png", "ftp://example.com/a.png", "gopher://x"])  # fmt: skip
    if kind == "unsupported":
        buf = io.BytesIO()
        tiny_image(1).save(buf, format=rng.choice(["TIFF", "ICO", "PPM"]))
        return b64(buf.getvalue())
    if kind == "junk_url":
        return rng.choice(["", "data:", "data:image/png,notbase64", "x" * 5000, 7, None, {"u": 1}, [b64(good)]])
    return b64(good)


def image_attacks(rng: random.Random, count: int, max_images: int) -> Iterator[tuple[str, Attack]]:
    """``count`` seeded bad image parts, every kind in turn, each on a random API (chat ``image_url``,
    ``/generate`` ``image_data``, Responses ``input_image``, ``/v1/embeddings``' ``messages``): each
    must be a 400 naming the part."""
    for i in range(count):
        kind = IMAGE_KINDS[i % len(IMAGE_KINDS)]
        api = rng.choice(["chat", "generate", "responses", "embeddings"])
        good = bad_image_url("good", rng)
        if kind == "too_many":
            urls, bad_at = [good] * (max_images + 1), max_images
        else:
            urls = [good] * rng.randint(0, max_images - 1)
            bad_at = len(urls)
            urls.append(bad_image_url(kind, rng))
        yield f"image_{kind}", lambda t, a=api, u=urls, k=bad_at: _image_request(t, a, u, k)


def _image_request(t: Target, api: str, urls: list, bad_at: int) -> Outcome:
    if api in ("chat", "embeddings"):
        parts = [{"type": "text", "text": "look"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        body = {"model": "default", "messages": [{"role": "user", "content": parts}]}
        if api == "chat":
            body["max_tokens"] = 2
        path = "/v1/chat/completions" if api == "chat" else "/v1/embeddings"
        want = f"messages[0].content[{bad_at + 1}]"
    elif api == "generate":
        text = "<|user|>" + "<image>" * len(urls) + "</s><|assistant|>"
        body = {"text": text, "image_data": urls, "sampling_params": {"max_new_tokens": 2}}
        path, want = "/generate", f"image_data[{bad_at}]"
    else:
        parts = [{"type": "input_text", "text": "look"}] + [{"type": "input_image", "image_url": u} for u in urls]
        body = {"model": "default", "input": [{"role": "user", "content": parts}], "max_output_tokens": 2}
        path, want = "/v1/responses", f"input.0.content.{bad_at + 1}"
    t0 = time.monotonic()
    r = httpx.post(t.url + path, json=body, headers=t.headers(), timeout=BOUND_S * 2)
    out = Outcome(r.status_code, time.monotonic() - t0)
    param = r.json().get("error", {}).get("param") if r.status_code == 400 else None
    if r.status_code != 400 or param != want:
        out.wrong = f"{api}: {r.status_code} naming {param!r}, not a 400 naming {want} ({r.text[:160]})"
    return out


def judge(kind: str, out: Outcome, t: Target) -> str | None:
    """What is wrong with an attack's outcome, or None."""
    if out.wrong is not None:
        return f"{kind}: {out.wrong}"
    limit = BOUND_S + (t.body_timeout_s if kind == "stalled_body" else 0)
    if out.seconds > limit:
        return f"{kind}: answered after {out.seconds:.1f} s (bound {limit:.0f} s)"
    if out.status is None:
        # The connection closed: allowed, but a stalled body must be answered, not waited out.
        return f"{kind}: no answer in {out.seconds:.1f} s" if kind == "stalled_body" and out.seconds >= limit else None
    if out.status >= 500:
        return f"{kind}: a {out.status}"
    if kind == "other_tenant" and out.status != 404:
        return f"{kind}: {out.status}, not the 404 an unknown id gets"
    if 200 <= out.status < 300 and not out.ok_2xx:
        return f"{kind}: {out.status} for a hostile request"
    return None
