"""The real server: bad input on every endpoint is a 4xx in the OpenAI shape and allocates nothing;
the API key; the engine killed under load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.server_harness import Server, gen, process_alive

# -- bad inputs -------------------------------------------------------------------------------------


BAD_SAMPLING = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": -1}, "max"),
    ({"max_tokens": "10"}, "max"),
    ({"n": 1000000}, "n"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [999999]}, "stop_token_ids"),
]


def _post_raw(srv, path: str, body: str | bytes) -> httpx.Response:
    return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)


def _body(endpoint: str, prompt, extra: dict) -> dict:
    if endpoint == "/generate":
        sp = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in extra.items() if k != "n"}
        body = {"input_ids" if isinstance(prompt, list) else "text": prompt, "sampling_params": sp}
        if "n" in extra:
            body["sampling_params"]["n"] = extra["n"]
        return body
    if endpoint == "/v1/completions":
        return {"model": "default", "prompt": prompt, **extra}
    content = prompt if isinstance(prompt, str) else "x"
    return {"model": "default", "messages": [{"role": "user", "content": content}], **extra}


def _assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("endpoint", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_bad_inputs_get_400_and_allocate_nothing(srv, endpoint):
    before = srv.info()["memory"]
    for extra, param in BAD_SAMPLING:
        body = json.dumps(_body(endpoint, "hello", extra), allow_nan=True)
        err = _assert_error(_post_raw(srv, endpoint, body), 400)
        assert param in (err["param"] or ""), (extra, err)
    # empty prompt / messages
    empty = {
        "/generate": {"text": ""},
        "/v1/completions": {"prompt": ""},
        "/v1/chat/completions": {"messages": []},
    }[endpoint]
    _assert_error(_post_raw(srv, endpoint, json.dumps(empty)), 400)
    if endpoint != "/v1/chat/completions":
        for ids in ([1, 2, 999], [1, -2], [1, 2.5]):
            _assert_error(_post_raw(srv, endpoint, json.dumps(_body(endpoint, ids, {}))), 400)
        err = _assert_error(_post_raw(srv, endpoint, json.dumps(_body(endpoint, [5] * 1024, {}))), 400)
        assert err["code"] == "context_length_exceeded"
    else:
        r = _post_raw(
            srv, endpoint, json.dumps({**_body(endpoint, "x", {}), "logprobs": True, "top_logprobs": 21})
        )
        _assert_error(r, 400)
        err = _assert_error(_post_raw(srv, endpoint, json.dumps(_body(endpoint, "y" * 1100, {}))), 400)
        assert err["code"] == "context_length_exceeded"
    _assert_error(_post_raw(srv, endpoint, b'{"prompt": "x",'), 400)
    _assert_error(_post_raw(srv, endpoint, b"x" * 300000), 413)
    assert srv.info()["memory"] == before
    ok = gen(srv, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3


def test_unknown_model_route_and_rid(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert _assert_error(r, 404)["code"] == "model_not_found"
    _assert_error(httpx.get(srv.url + "/no/such/path"), 404)
    _assert_error(httpx.post(srv.url + "/abort_request", json={"rid": "nope"}), 404)


# -- engine death ---------------------------------------------------------------------------------------


def test_engine_killed_gives_503_then_recovers(server):
    pid = server.info()["engine_pid"]
    restarts = server.info()["engine_restarts"]
    sid = httpx.post(server.url + "/open_session", json={}).json()
    first = gen(server, {"input_ids": [3, 4], "session_params": {"id": sid}})
    assert first.status_code == 200

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            inflight = asyncio.create_task(
                c.post(
                    "/generate",
                    json={
                        "input_ids": [4] * 8,
                        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
                    },
                )
            )
            await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            while (await c.get("/health")).status_code != 503:
                assert time.monotonic() - t0 < 1.0
                await asyncio.sleep(0.05)
            r = await inflight
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            assert (await c.post("/generate", json={"input_ids": [1]})).status_code == 503

    asyncio.run(main())
    server.wait_healthy(timeout=120)
    assert server.info()["engine_restarts"] == restarts + 1
    r = gen(server, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200
    # The session lived in the dead engine; the front re-opened it on the new one from its tokens.
    again = gen(
        server, {"input_ids": [7], "session_params": {"id": sid}, "sampling_params": {"max_new_tokens": 2}}
    )
    assert again.status_code == 200, again.text
    assert again.json()["meta_info"]["prompt_tokens"] == 2 + len(first.json()["output_ids"]) + 1
    assert httpx.post(server.url + "/close_session", json={"session_id": sid}).status_code == 200
    assert not process_alive(pid)
    server.wait_idle_clean()
    assert "engine process died" in server.logs()


def test_api_key(chat_model, tmp_path):
    s = Server(
        chat_model,
        "--api-key",
        "sekrit",
        "--max-total-tokens",
        "1024",
        "--log-level",
        "warning",
        log_path=str(tmp_path / "key.log"),
    )
    try:
        s.wait_healthy()
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
        r = httpx.post(s.url + "/generate", json={"input_ids": [1, 2]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (
            httpx.get(s.url + "/get_server_info", headers={"Authorization": "Bearer wrong"}).status_code
            == 401
        )
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert c.completions.create(model="default", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        # The user key is not an admin key: without --admin-api-key (or --admin-open) admin paths are 403.
        key = {"Authorization": "Bearer sekrit"}
        for path in ("/flush_cache", "/pause_generation"):
            r = httpx.post(s.url + path, json={}, headers=key, timeout=30)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", r.text
        assert httpx.get(s.url + "/get_server_info", headers=key, timeout=30).json()["generation_paused"] is None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        assert s.stop() == 0
