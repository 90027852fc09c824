"""Fault tolerance of the real server: contained faults, watchdog, graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.server_harness import Server

ARGS = [
    "--dtype",
    "float32",
    "--strict-memory",
    "--page-size",
    "16",
    "--max-total-tokens",
    "4096",
    "--log-level",
    "warning",
]


@pytest.fixture(scope="module")
def faulty(chat_model, tmp_path_factory):
    s = Server(
        chat_model,
        *ARGS,
        "--watchdog-timeout",
        "2",
        log_path=str(tmp_path_factory.mktemp("logs") / "faulty.log"),
        env={"KVLEDGER_TEST_FAULT_RIDS": "bad-1", "KVLEDGER_TEST_STALL_RID": "stall-1"},
    )
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def test_faulty_request_gets_500_neighbours_unchanged(faulty):
    body = {"sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}}
    alone = [
        httpx.post(faulty.url + "/generate", json={**body, "input_ids": [5 + i] * 7}, timeout=30).json()
        for i in range(3)
    ]

    async def main():
        async with httpx.AsyncClient(base_url=faulty.url, timeout=30) as c:
            reqs = [c.post("/generate", json={**body, "input_ids": [5 + i] * 7}) for i in range(3)]
            bad = c.post("/generate", json={**body, "input_ids": [9] * 7, "rid": "bad-1"})
            return await asyncio.gather(bad, *reqs)

    bad, *good = asyncio.run(main())
    assert bad.status_code == 500
    err = bad.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "injected fault" in err["message"]
    assert [g.json()["output_ids"] for g in good] == [a["output_ids"] for a in alone]
    faulty.wait_idle_clean()
    assert faulty.info()["engine_restarts"] == 0


def test_watchdog_catches_a_stall_and_recovers(faulty):
    restarts = faulty.info()["engine_restarts"]

    async def main():
        async with httpx.AsyncClient(base_url=faulty.url, timeout=30) as c:
            stuck = asyncio.create_task(c.post("/generate", json={"input_ids": [4, 5], "rid": "stall-1"}))
            t0 = time.monotonic()
            while (await c.get("/health")).status_code == 200:
                assert time.monotonic() - t0 < 2 + 1.0, "watchdog too slow"
                await asyncio.sleep(0.05)
            r = await stuck
            assert r.status_code == 503

    asyncio.run(main())
    faulty.wait_healthy(timeout=120)
    assert faulty.info()["engine_restarts"] == restarts + 1
    assert "kvledger_watchdog_stalls_total 1.0" in httpx.get(faulty.url + "/metrics").text
    r = httpx.post(
        faulty.url + "/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}}
    )
    assert r.status_code == 200
    faulty.wait_idle_clean()


def test_health_reports_a_stuck_step_before_the_watchdog(faulty):
    """A step that does not end: /health answers 503 in the OpenAI error shape (engine_stalled) once
    it has run half the watchdog's limit, while the engine process is still up and before the
    watchdog kills it (then engine_not_ready while it restarts)."""
    restarts = faulty.info()["engine_restarts"]

    async def main():
        async with httpx.AsyncClient(base_url=faulty.url, timeout=30) as c:
            stuck = asyncio.create_task(c.post("/generate", json={"input_ids": [4, 5], "rid": "stall-1"}))
            t0 = time.monotonic()
            while (h := await c.get("/health")).status_code == 200:
                assert time.monotonic() - t0 < 2 + 1.0, "no 503 while the step was stuck"
                await asyncio.sleep(0.05)
            first = h
            await stuck
            return first

    first = asyncio.run(main())
    assert first.status_code == 503
    err = first.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "engine_stalled" and err["type"] == "service_unavailable", err
    faulty.wait_healthy(timeout=120)
    assert faulty.info()["engine_restarts"] == restarts + 1  # the watchdog still ends the stuck step
    faulty.wait_idle_clean()


def test_sigterm_with_requests_in_flight(chat_model, tmp_path):
    s = Server(
        chat_model, *ARGS, "--log-level", "info", "--grace-period", "0.5", log_path=str(tmp_path / "term.log")
    )
    s.wait_healthy()
    engine_pid = s.info()["engine_pid"]
    sid = httpx.post(s.url + "/open_session", json={}).json()
    first_turn = {
        "input_ids": [5] * 20,
        "sampling_params": {"max_new_tokens": 4},
        "session_params": {"id": sid},
    }
    assert httpx.post(s.url + "/generate", json=first_turn).status_code == 200
    short = {"input_ids": [3] * 5, "sampling_params": {"max_new_tokens": 20}}
    long = {"input_ids": [4] * 5, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            tasks = [asyncio.create_task(c.post("/generate", json=b)) for b in (short, long, long, long)]
            await asyncio.sleep(0.3)
            s.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
            late = await c.post("/generate", json=short)  # within the grace period: still listening
            return late, await asyncio.gather(*tasks)

    late, (done_short, *done_long) = asyncio.run(main())
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
    assert done_short.status_code == 200 and len(done_short.json()["output_ids"]) > 0
    for r in done_long:  # 1000 tokens each cannot finish in the grace period: aborted, with a reason
        assert r.status_code == 200
        fr = r.json()["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and "shutting down" in fr["message"], fr
        assert 0 < len(r.json()["output_ids"]) < 1000
    assert s.proc.wait(timeout=30) == 0
    assert "engine shut down: 1 session(s) closed" in s.logs()  # the session was released, not lost
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)  # no orphan engine process
    s.stop()
