"""The real server on loopback, driven with the `openai` client, httpx and raw bodies."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.server_harness import Server


def gen(srv, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.url + "/generate", json=body, timeout=60, **kw)


# -- happy paths --------------------------------------------------------------------------------------


def test_chat_and_completions_streamed_equals_unstreamed(srv, client):
    msgs = [{"role": "user", "content": "Say something in ünïcode ✓"}]
    full = client.chat.completions.create(model="default", messages=msgs, max_tokens=40, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    parts = []
    finish = None
    for ch in client.chat.completions.create(
        model="default", messages=msgs, max_tokens=40, temperature=0, stream=True
    ):
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
    assert "".join(parts) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason

    comp = client.completions.create(model="default", prompt="Hello there", max_tokens=30, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="default", prompt="Hello there", max_tokens=30, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == comp.choices[0].text
    assert "\ufffd" not in streamed or "\ufffd" in comp.choices[0].text


def test_greedy_matches_offline_engine(srv, client, chat_model):
    from kvledger import Engine

    eng = Engine(chat_model, dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    ids = eng.tokenizer.encode("The sky is")
    offline = eng.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    )
    r = gen(
        srv,
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}},
    )
    assert r.status_code == 200
    assert r.json()["output_ids"] == offline["output_ids"]
    c = client.completions.create(
        model="default", prompt=ids, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.choices[0].text == offline["text"]


def test_generate_stream_is_cumulative_and_ends_with_done(srv):
    body = {
        "text": "abc",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", srv.url + "/generate", json=body, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert [len(e["output_ids"]) for e in events] == list(range(1, 9))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(b["text"].startswith(a["text"]) for a, b in itertools.pairwise(events))


def test_n_choices_logprobs_and_models(srv, client):
    r = client.completions.create(
        model="default", prompt="x", max_tokens=5, n=3, temperature=1.0, logprobs=3, seed=1
    )
    assert len(r.choices) == 3 and r.usage.completion_tokens == 15
    assert len(r.choices[0].logprobs.top_logprobs[0]) == 3
    c = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=20,
        temperature=0,
    )
    assert len(c.choices[0].logprobs.content[0].top_logprobs) == 20
    models = client.models.list()
    assert models.data[0].id


def test_native_logprobs_and_stop_string(srv):
    r = gen(
        srv,
        {
            "input_ids": [40, 41, 42],
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        },
    )
    meta = r.json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == len(r.json()["output_ids"])
    assert all(len(x) == 2 for x in meta["output_top_logprobs"])


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
    ok = gen(srv, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3


def test_unknown_model_route_and_rid(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert _assert_error(r, 404)["code"] == "model_not_found"
    _assert_error(httpx.get(srv.url + "/no/such/path"), 404)
    _assert_error(httpx.post(srv.url + "/abort_request", json={"rid": "nope"}), 404)


# -- aborts, disconnects, duplicates ------------------------------------------------------------------


def _running(srv) -> int:
    m = srv.info()["memory"]
    return m["req_slots_total"] - m["req_slots_free"]


def test_disconnect_mid_stream_aborts_within_a_second(srv):
    body = {
        "input_ids": [7] * 20,
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", srv.url + "/generate", json=body, timeout=30) as r:
        it = r.iter_lines()
        next(ln for ln in it if ln.startswith("data:"))
        assert _running(srv) == 1
    deadline = time.monotonic() + 1.0
    while _running(srv) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(srv) == 0


def test_disconnect_while_waiting_for_a_non_streamed_answer(srv):
    body = {"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/generate", json=body, timeout=0.3)
    deadline = time.monotonic() + 1.5
    while _running(srv) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(srv) == 0
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'kvledger_aborted_requests_total{reason="client_disconnect"}' in metrics


def test_abort_by_rid_and_duplicate_rid(srv):
    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            body = {
                "input_ids": [9] * 10,
                "rid": "dup-1",
                "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
            }
            first = asyncio.create_task(c.post("/generate", json=body))
            for _ in range(100):
                await asyncio.sleep(0.05)
                if _running(srv):
                    break
            second = await c.post("/generate", json=body)
            assert second.status_code == 409 and second.json()["error"]["code"] == "duplicate_rid"
            flush = await c.post("/flush_cache")
            assert flush.status_code == 409
            assert (await c.post("/abort_request", json={"rid": "dup-1"})).status_code == 200
            r = await first
            assert r.status_code == 200
            assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(r.json()["output_ids"]) < 900

    asyncio.run(main())
    assert httpx.post(srv.url + "/flush_cache").status_code == 200


def test_queue_overflow_gets_429_and_accepted_all_complete(srv):
    async def main():
        async with httpx.AsyncClient(
            base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=200)
        ) as c:
            body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 250, "ignore_eos": True}}
            return await asyncio.gather(*(c.post("/generate", json=body) for _ in range(120)))

    rs = asyncio.run(main())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) >= 64
    for r in rs:
        if r.status_code == 200:
            assert len(r.json()["output_ids"]) == 250
        else:
            assert r.json()["error"]["code"] == "queue_full"


def test_health_generate_under_load_leaves_nothing(srv):
    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            load = [
                c.post("/generate", json={"input_ids": [3] * 30, "sampling_params": {"max_new_tokens": 60}})
                for _ in range(6)
            ]
            health = [c.get("/health_generate") for _ in range(20)]
            return await asyncio.gather(*load, *health)

    rs = asyncio.run(main())
    assert all(r.status_code == 200 for r in rs)
    assert httpx.get(srv.url + "/health").status_code == 200


def test_metrics_gauges_drop_after_mass_abort(srv):
    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            body = {"sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
            tasks = [
                asyncio.create_task(
                    c.post("/generate", json={**body, "input_ids": [i + 3] * 9, "rid": f"m{i}"})
                )
                for i in range(6)
            ]
            await asyncio.sleep(0.5)
            for i in range(6):
                await c.post("/abort_request", json={"rid": f"m{i}"})
            await asyncio.gather(*tasks)

    asyncio.run(main())
    time.sleep(1.0)
    text = httpx.get(srv.url + "/metrics").text
    for name in ("kvledger_num_running_requests", "kvledger_num_waiting_requests"):
        line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
        assert float(line.split()[1]) == 0.0, line
    for name in (
        "kvledger_time_to_first_token_seconds_count",
        "kvledger_e2e_request_latency_seconds_count",
        "kvledger_inter_token_latency_seconds_count",
        "kvledger_kv_tokens",
        "kvledger_num_streaming_sessions",
        "kvledger_memory_audit_runs",
        "kvledger_prompt_tokens_total",
        "kvledger_generation_tokens_total",
    ):
        assert name in text, name


def test_server_info_memory_object(srv):
    m = srv.info()["memory"]
    for key in (
        "kv_total",
        "kv_free",
        "kv_cached_evictable",
        "kv_cached_protected",
        "kv_private",
        "kv_session",
        "req_slots_total",
        "req_slots_free",
        "leak_check",
    ):
        assert key in m
    assert set(m["leak_check"]) == {"ok", "checks", "violations"}


# -- engine death ---------------------------------------------------------------------------------------


def test_engine_killed_gives_503_then_recovers(server):
    pid = server.info()["engine_pid"]
    restarts = server.info()["engine_restarts"]
    sid = httpx.post(server.url + "/open_session", json={}).json()
    assert gen(server, {"input_ids": [3, 4], "session_params": {"id": sid}}).status_code == 200

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
    # The session lived in the dead engine: reported closed, nothing hangs.
    gone = gen(server, {"input_ids": [7], "session_params": {"id": sid}})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
    assert not process_alive(pid)
    server.wait_idle_clean()
    assert "engine process died" in server.logs()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); the front reaps its children, so look at the state too.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


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
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        assert s.stop() == 0
