"""The real server: aborts, disconnects, duplicate rids, the queue limit, health checks under load,
metrics and the memory object."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

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
    assert set(m["leak_check"]) >= {"ok", "checks", "violations", "quarantined_pages_total", "contained_errors"}
