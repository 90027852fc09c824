"""Remote image URLs (``multimodal/remote.py``) against this test's own HTTP server, bound to
127.0.0.1, and nothing else: the default policy refuses it (loopback) whatever name leads there;
the size cap, the total time limit and the redirect limit are tested by injecting a policy that
lets 127.0.0.1 through (and a resolver that maps test names to it), which only this test does.
No other address is ever connected to: a name that resolves elsewhere is refused before any
connection."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvledger.errors import ValidationError
from kvledger.multimodal.media import MediaLimits
from kvledger.multimodal.remote import RemoteFetcher, public_only
from tests.helpers import tiny_image

LOOPBACK = ipaddress.ip_address("127.0.0.1")


def png() -> bytes:
    buf = io.BytesIO()
    tiny_image(3).save(buf, format="PNG")
    return buf.getvalue()


class Media(BaseHTTPRequestHandler):
    """/img.png; /big (50 MB, no length, streamed); /declared (a length past any cap); /slow (a byte
    every 0.2 s); /hop/N (N redirects then the image); /to/URL (one redirect to URL)."""

    protocol_version = "HTTP/1.1"
    seen: list[dict] = []  # noqa: RUF012 (the test's record of what arrived)
    big_done = threading.Event()

    def log_message(self, *a) -> None:
        pass

    def do_GET(self) -> None:
        Media.seen.append({"path": self.path, "host": self.headers.get("Host")})
        body = png()
        if self.path == "/img.png":
            self._send(200, body)
        elif self.path == "/big":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for _ in range(800):
                    self.wfile.write(b"\0" * 65536)
                Media.big_done.set()
            except OSError:
                pass
        elif self.path == "/declared":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
        elif self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass
        elif self.path.startswith("/hop/"):
            n = int(self.path.split("/")[2])
            self._redirect(f"/hop/{n - 1}" if n > 1 else "/img.png")
        elif self.path.startswith("/to/"):
            self._redirect(self.path[len("/to/"):])
        else:
            self._send(404, b"")

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where: str) -> None:
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def media_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Media)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


NAMES = {"media.test": ["127.0.0.1"], "elsewhere.test": ["10.1.2.3"], "mixed.test": ["8.8.8.8", "127.0.0.1"]}


async def fake_resolve(host: str, port: int) -> list[str]:
    """Test names only: anything else is an error, never a real lookup."""
    if host not in NAMES:
        raise OSError(f"{host}: not a test name")
    return NAMES[host]


def loopback_only(addr) -> str | None:
    """The permissive policy of these tests: 127.0.0.1 and nothing else."""
    return None if addr == LOOPBACK else "not the test's server"


def fetcher(policy=loopback_only, **kw) -> RemoteFetcher:
    limits = MediaLimits(allow_remote_media=True, **{"max_image_bytes": 1 << 20, "media_fetch_timeout_s": 5.0, **kw})
    return RemoteFetcher(limits, policy=policy, resolve=fake_resolve)


def fetch(f: RemoteFetcher, url: str) -> bytes:
    return asyncio.run(f.fetch(url, "messages[0].content[1]"))


def refused(f: RemoteFetcher, url: str, words: str) -> str:
    with pytest.raises(ValidationError) as e:
        fetch(f, url)
    assert e.value.param == "messages[0].content[1]"
    assert words in str(e.value), str(e.value)
    return str(e.value)


def test_default_policy_refuses_private_addresses():
    for a in ("127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "0.0.0.0", "224.0.0.1",
              "240.0.0.1", "100.64.0.1", "::1", "::", "fe80::1", "fc00::1", "ff02::1", "::ffff:127.0.0.1",
              "::ffff:10.0.0.1", "192.0.2.1"):  # fmt: skip
        assert public_only(ipaddress.ip_address(a)) is not None, a
    for a in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"):
        assert public_only(ipaddress.ip_address(a)) is None, a


def test_the_tests_own_server_is_refused_as_private(media_server):
    f = fetcher(policy=public_only)
    n = len(Media.seen)
    refused(f, f"http://127.0.0.1:{media_server}/img.png", "loopback")
    refused(f, f"http://media.test:{media_server}/img.png", "loopback")  # by name too
    refused(f, f"http://mixed.test:{media_server}/img.png", "loopback")  # one bad address of several
    refused(f, f"http://[::ffff:127.0.0.1]:{media_server}/img.png", "loopback")
    refused(f, f"http://[::1]:{media_server}/img.png", "loopback")
    assert len(Media.seen) == n  # refused before any connection


def test_flag_scheme_and_domains():
    off = RemoteFetcher(MediaLimits(), resolve=fake_resolve)
    refused(off, "http://media.test/img.png", "--allow-remote-media")
    f = fetcher()
    refused(f, "ftp://media.test/img.png", "only http and https")
    refused(f, "http://user:pw@media.test/img.png", "credentials")
    refused(f, "http://nowhere.test/img.png", "does not resolve")
    refused(fetcher(allowed_media_domains=("images.test",)), "http://media.test/img.png", "--allowed-media-domains")


def test_fetch_connects_to_the_checked_address(media_server):
    f = fetcher()
    assert fetch(f, f"http://media.test:{media_server}/img.png") == png()
    assert Media.seen[-1] == {"path": "/img.png", "host": f"media.test:{media_server}"}  # the name in Host
    assert fetch(fetcher(allowed_media_domains=("test",)), f"http://media.test:{media_server}/img.png") == png()
    refused(f, f"http://media.test:{media_server}/missing", "HTTP 404")


def test_size_cap_stops_reading(media_server):
    f = fetcher(max_image_bytes=100_000)
    Media.big_done.clear()
    refused(f, f"http://media.test:{media_server}/big", "larger than 100000 bytes")
    time.sleep(0.5)
    assert not Media.big_done.is_set()  # the 50 MB body was not read to its end
    refused(f, f"http://media.test:{media_server}/declared", "larger than 100000 bytes")


def test_total_time_limit(media_server):
    t0 = time.monotonic()
    refused(fetcher(media_fetch_timeout_s=1.0), f"http://media.test:{media_server}/slow", "longer than 1.0 s")
    assert time.monotonic() - t0 < 3  # the whole fetch, though every read came in time


def test_redirect_limit_and_every_hop_checked(media_server):
    base = f"http://media.test:{media_server}"
    assert fetch(fetcher(media_max_redirects=3), f"{base}/hop/3") == png()
    refused(fetcher(media_max_redirects=2), f"{base}/hop/3", "more than 2 times")
    refused(fetcher(media_max_redirects=0), f"{base}/hop/1", "more than 0 times")
    f = fetcher()
    n = len(Media.seen)
    refused(f, f"{base}/to/http://elsewhere.test/img.png", "10.1.2.3")  # the second hop's address refused
    refused(f, f"{base}/to/file:///etc/passwd", "only http and https")
    refused(fetcher(policy=public_only), f"http://127.0.0.1:{media_server}/to/http://8.8.8.8/", "loopback")
    assert len(Media.seen) == n + 2  # only the first hops reached the test's server; nothing else was


def test_the_loop_serves_on_while_a_fetch_waits(media_server):
    async def both() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(tick())
        with pytest.raises(ValidationError):
            await fetcher(media_fetch_timeout_s=1.0).fetch(f"http://media.test:{media_server}/slow", "p")
        t.cancel()
        return ticks

    assert asyncio.run(both()) >= 10


def test_fetch_all_gives_each_url_once_or_the_first_refusal(media_server):
    base = f"http://media.test:{media_server}"
    f = fetcher()
    got = asyncio.run(f.fetch_all([(f"{base}/img.png", "a"), (f"{base}/hop/1", "b"), (f"{base}/img.png", "c")]))
    assert got == {f"{base}/img.png": png(), f"{base}/hop/1": png()}
    with pytest.raises(ValidationError) as e:  # a plain 400, not an exception group
        asyncio.run(f.fetch_all([(f"{base}/img.png", "a"), (f"{base}/missing", "b")]))
    assert e.value.param == "b" and "HTTP 404" in str(e.value)
