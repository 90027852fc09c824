"""What one body and one caller may ask of the engine (issue 50, item 3): a body of 20,000 prompts x
n=4 is a 400 in bounded time while /health answers; prompts, prompts x n and prompt tokens per body
are capped with a 400 naming the flag, before anything reaches the engine; a caller's requests in
flight are capped with a 429 and ``Retry-After``; a body whose request fails, or whose client leaves,
leaves none of its requests running. Every server's books clean at the end."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx
import pytest

from tests.integration.conftest import started_server

KEY = {"Authorization": "Bearer user-key"}


@pytest.fixture(scope="module")
def capped(chat_model, tmp_path_factory):
    yield from started_server(
        chat_model, str(tmp_path_factory.mktemp("admission") / "s.log"),
        "--api-key", "user-key", "--max-prompt-tokens-per-request", "64", "--max-requests-per-key", "4",
    )  # fmt: skip


@pytest.fixture
def cap(capped):
    capped.headers = KEY
    yield capped
    capped.wait_idle_clean()


def running(s) -> int:
    load = httpx.get(s.url + "/get_load", headers=s.headers, timeout=10).json()[0]
    return load["num_reqs"] + load["num_waiting_reqs"]


def requests_seen(s) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(s.url + "/metrics", timeout=10).text.splitlines()
        if line.startswith("kvledger_requests_total{")
    )


def test_a_body_of_20000_prompts_times_4_is_refused_fast_while_health_answers(srv):
    body = {"model": "default", "prompt": [f"p{i}" for i in range(20000)], "n": 4, "max_tokens": 4}
    before = requests_seen(srv)
    health: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
            health.append(time.monotonic() - t)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        t = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        took = time.monotonic() - t
    finally:
        done.set()
        poller.join()
    assert r.status_code == 400 and took < 10, (r.status_code, took)
    err = r.json()["error"]
    assert err["code"] == "too_many_prompts" and "--max-prompts-per-request" in err["message"], err
    assert health and max(health) < 2, health
    assert requests_seen(srv) == before  # nothing reached the engine


@pytest.mark.parametrize(
    "route, body, param, code",
    [
        ("/v1/completions", {"prompt": ["a"] * 300, "n": 4}, "n", "too_many_choices"),
        ("/v1/completions", {"prompt": [[5, 6]] * 2049}, "prompt", "too_many_prompts"),
        ("/generate", {"text": ["a"] * 2049}, "text", "too_many_prompts"),
        ("/generate", {"input_ids": [[5]] * 2049}, "input_ids", "too_many_prompts"),
        ("/v1/embeddings", {"input": ["a"] * 2049}, "input", "too_many_prompts"),
        ("/v1/rerank", {"query": "q", "documents": ["a"] * 2049}, "documents", "too_many_prompts"),
    ],
)  # fmt: skip
def test_fan_out_past_a_limit_is_a_400_naming_it(srv, route, body, param, code):
    before = requests_seen(srv)
    r = httpx.post(srv.url + route, json={"model": "default", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code) and "--max-" in err["message"], err
    assert requests_seen(srv) == before


def test_prompt_tokens_per_body_are_capped(cap):
    before = requests_seen(cap)
    r = httpx.post(cap.url + "/v1/completions", headers=KEY, timeout=30,
                   json={"model": "default", "prompt": [[5] * 30, [6] * 30, [7] * 30], "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompt_tokens", r.text
    assert "--max-prompt-tokens-per-request" in r.json()["error"]["message"]
    r = httpx.post(cap.url + "/generate", headers=KEY, timeout=30, json={"input_ids": [[5] * 40, [6] * 40]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompt_tokens", r.text
    assert requests_seen(cap) == before
    ok = httpx.post(cap.url + "/v1/completions", headers=KEY, timeout=30,
                    json={"model": "default", "prompt": [[5] * 30, [6] * 30], "max_tokens": 1})  # fmt: skip
    assert ok.status_code == 200, ok.text


def test_a_callers_requests_in_flight_are_capped_with_429_and_retry_after(cap):
    """4 in flight per key: a body needing 5 is refused whole before anything starts; 4 running
    streams and a fifth request: 429 with Retry-After; once they end, the key may start again."""
    r = httpx.post(cap.url + "/v1/completions", headers=KEY, timeout=30,
                   json={"model": "default", "prompt": "a", "n": 5, "max_tokens": 1})  # fmt: skip
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "too_many_requests_in_flight"
    long = {"text": "a", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    started = threading.Barrier(5)

    def stream() -> int:
        with httpx.stream("POST", cap.url + "/generate", headers=KEY, json=long, timeout=120) as s:
            lines = s.iter_lines()
            next(lines)
            started.wait(timeout=60)
            return sum(1 for _ in lines)

    with cf.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream) for _ in range(4)]
        started.wait(timeout=60)
        r = httpx.post(cap.url + "/generate", headers=KEY, json={"text": "b"}, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert all(f.result(timeout=120) > 0 for f in streams)
    assert httpx.post(cap.url + "/generate", headers=KEY, json={"text": "b"}, timeout=30).status_code == 200


def test_a_failed_body_leaves_none_of_its_requests_running(srv):
    """8 running + 64 queued fit in the engine: of one body's 80 long prompts the last 8 find the
    queue full (429). The body fails, and its 72 admitted requests are aborted at once (before: left
    running to their 400 tokens after the client had its 429)."""
    body = {"model": "default", "prompt": [[5 + i % 50] for i in range(80)], "max_tokens": 400, "ignore_eos": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    t = time.monotonic()
    while running(srv) and time.monotonic() - t < 3:
        time.sleep(0.05)
    assert running(srv) == 0


def test_a_client_that_leaves_aborts_every_request_of_its_body(cap):
    """Three long requests in one body; the client leaves at once: all three are aborted for the
    disconnect (counted so), and the engine holds nothing soon after."""
    def aborted() -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(cap.url + "/metrics", timeout=10).text.splitlines()
            if line.startswith('kvledger_aborted_requests_total{reason="client_disconnect"}')
        )

    before = aborted()
    body = {"model": "default", "prompt": [[5], [6], [7]], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cap.url + "/v1/completions", headers=KEY, json=body, timeout=0.3)
    deadline = time.monotonic() + 5
    while (running(cap) or aborted() < before + 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(cap) == 0 and aborted() == before + 3
