"""Remote image URLs through the real server with ``--allow-remote-media``: this test's own HTTP
server, bound to 127.0.0.1, is refused as a loopback address (by address and by name) on every API
that takes images — chat ``image_url``, Responses ``input_image``, ``/generate`` ``image_data`` — a
400 naming the part, with nothing fetched and nothing held; the server serves on. (The limits of an
allowed fetch are ``tests/unit/test_remote_media.py``'s: only there may 127.0.0.1 be let through.)"""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import httpx
import openai
import pytest

from tests.helpers import tiny_image
from tests.integration.conftest import started_server
from tests.integration.test_vision_server import ask, data_url
from tests.unit.test_remote_media import Media


@pytest.fixture(scope="module")
def media_port():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Media)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def remote_server(llava, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "remote.log")
    yield from started_server(llava[0], log, "--page-size", "4", "--allow-remote-media", "--media-fetch-timeout-s", "5")


def test_loopback_refused_everywhere_and_the_server_serves_on(remote_server, media_port):
    c = openai.OpenAI(base_url=remote_server.url + "/v1", api_key="none", max_retries=0)
    restarts = remote_server.info()["engine_restarts"]
    seen = len(Media.seen)
    for url in (f"http://127.0.0.1:{media_port}/img.png", f"http://localhost:{media_port}/img.png",
                f"http://[::ffff:127.0.0.1]:{media_port}/img.png"):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            ask(c, ["look ", data_url(tiny_image(1)), url])
        assert e.value.body["param"] == "messages[0].content[2]", e.value.body
        assert "loopback" in e.value.body["message"], e.value.body
    url = f"http://127.0.0.1:{media_port}/img.png"
    r = httpx.post(remote_server.url + "/generate", timeout=30, json={
        "text": "<|user|>a <image></s><|assistant|>", "image_data": [url], "sampling_params": {"max_new_tokens": 2},
    })  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data[0]", r.text
    assert "loopback" in r.json()["error"]["message"]
    r = httpx.post(remote_server.url + "/v1/responses", timeout=30, json={
        "model": "default", "max_output_tokens": 2,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                               {"type": "input_image", "image_url": url}]}],
    })  # fmt: skip
    assert r.status_code == 400 and "loopback" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "input.0.content.1"
    assert len(Media.seen) == seen  # nothing was fetched
    assert ask(c, ["still ", data_url(tiny_image(2))]).choices[0].finish_reason == "length"
    info = remote_server.wait_idle_clean()
    assert info["engine_restarts"] == restarts
    assert info["memory"].get("image_embed_tokens", 0) == 0
