"""The real server and the real openai client: a request's ``timeout`` (503 ``request_timeout`` in the
OpenAI error shape, queued or running, streamed or not) and ``--max-queued-prefill-tokens`` (429
``queue_full``, nothing allocated). One request runs at a time here, so a second one waits."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.integration.conftest import started_server

BLOCK = {"input_ids": [7] * 20, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}


@pytest.fixture(scope="module")
def one_slot(chat_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "timeouts.log")
    args = ("--max-running-requests", "1", "--max-queued-prefill-tokens", "64", "--request-timeout-s", "120")
    yield from started_server(chat_model, log, *args)


@pytest.fixture
def srv1(one_slot):
    yield one_slot
    one_slot.wait_idle_clean()


def _running(srv) -> int:
    m = srv.info()["memory"]
    return m["req_slots_total"] - m["req_slots_free"]


async def _blocked(srv, c: httpx.AsyncClient, rid: str) -> asyncio.Task:
    """A long request holding the only slot until it is aborted."""
    task = asyncio.create_task(c.post("/generate", json={**BLOCK, "rid": rid}))
    for _ in range(200):
        await asyncio.sleep(0.02)
        if _running(srv):
            return task
    raise AssertionError("the blocking request never ran")


async def _unblock(c: httpx.AsyncClient, rid: str, task: asyncio.Task) -> None:
    assert (await c.post("/abort_request", json={"rid": rid})).status_code == 200
    r = await task
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort"


def _is_timeout(e: openai.APIStatusError, where: str) -> None:
    assert e.status_code == 503, e
    err = e.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "request_timeout" and err["type"] == "service_unavailable"
    assert where in err["message"], err


def test_queued_request_times_out_with_503(srv1):
    async def main():
        oc = openai.AsyncOpenAI(base_url=srv1.url + "/v1", api_key="none", max_retries=0)
        async with httpx.AsyncClient(base_url=srv1.url, timeout=60) as c:
            task = await _blocked(srv1, c, "blk-q")
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as e:
                await oc.completions.create(model="default", prompt=[5] * 10, max_tokens=5, extra_body={"timeout": 0.3})
            assert time.monotonic() - t0 < 5
            _is_timeout(e.value, "in the queue")
            # Streamed: nothing was generated, so the answer is the 503 itself, not a 200 stream.
            with pytest.raises(openai.APIStatusError) as e:
                await oc.chat.completions.create(
                    model="default",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=5,
                    stream=True,
                    extra_body={"timeout": 0.3},
                )
            _is_timeout(e.value, "in the queue")
            await _unblock(c, "blk-q", task)
        await oc.close()

    asyncio.run(main())


def test_running_request_times_out_streamed_and_not(srv1):
    client = openai.OpenAI(base_url=srv1.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:  # SGLang's answer: the 503, not the partial text
        client.completions.create(
            model="default", prompt=[5] * 10, max_tokens=1000, extra_body={"ignore_eos": True, "timeout": 0.3}
        )
    _is_timeout(e.value, "while running")
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1000,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "timeout": 0.3},
        )
    )
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["abort"], finals  # the stream ends with a final chunk, as an abort does
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and 0 < usage.completion_tokens < 1000  # what it generated was streamed and stays
    m = httpx.get(srv1.url + "/metrics").text
    assert 'kvledger_aborted_requests_total{reason="timeout"}' in m


def test_generate_running_timeout_streamed_and_not(srv1):
    body = {"input_ids": [6] * 10, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "timeout": 0.3}}
    r = httpx.post(srv1.url + "/generate", json=body, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "request_timeout", r.text
    with httpx.stream("POST", srv1.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data:") and ln != "data: [DONE]"]
    last = events[-1]
    fr = last["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "timed out while running" in fr["message"], fr
    assert 0 < len(last["output_ids"]) < 1000  # SGLang's shape: everything so far, then the abort


def test_queued_prefill_token_budget_refuses_with_429(srv1):
    async def main():
        oc = openai.AsyncOpenAI(base_url=srv1.url + "/v1", api_key="none", max_retries=0)
        async with httpx.AsyncClient(base_url=srv1.url, timeout=60) as c:
            task = await _blocked(srv1, c, "blk-b")
            waiting = asyncio.create_task(
                c.post("/generate", json={"input_ids": [4] * 40, "sampling_params": {"max_new_tokens": 2}})
            )
            await asyncio.sleep(0.3)
            before = srv1.info()["memory"]
            with pytest.raises(openai.RateLimitError) as e:  # 40 waiting + 30 > 64
                await oc.completions.create(model="default", prompt=[5] * 30, max_tokens=2)
            err = e.value.response.json()["error"]
            assert err["code"] == "queue_full" and "--max-queued-prefill-tokens" in err["message"]
            assert set(err) == {"message", "type", "param", "code"}
            after = srv1.info()["memory"]
            assert after["req_slots_free"] == before["req_slots_free"]
            ok = asyncio.create_task(oc.completions.create(model="default", prompt=[5] * 20, max_tokens=2))
            await asyncio.sleep(0.2)  # 40 + 20 fits: queued, not refused
            assert not waiting.done() and not ok.done()
            await _unblock(c, "blk-b", task)
            assert (await waiting).status_code == 200
            assert (await ok).choices[0].finish_reason == "length"
        await oc.close()

    asyncio.run(main())


@pytest.mark.parametrize("bad", ["-1", "0", '"5"', "true", "1e12", "NaN", "Infinity", "[1]", "{}"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_bad_timeout_is_a_400(srv1, route, bad):
    if route == "/generate":
        body = '{"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, "timeout": BAD}}'
    elif route == "/v1/completions":
        body = '{"model": "default", "prompt": "hi", "max_tokens": 2, "timeout": BAD}'
    else:
        body = '{"model": "default", "messages": [{"role": "user", "content": "hi"}], "timeout": BAD}'
    body = body.replace("BAD", bad)
    r = httpx.post(srv1.url + route, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and err["param"] in ("timeout", "sampling_params"), err


def test_good_timeout_is_taken(srv1):
    r = httpx.post(
        srv1.url + "/generate",
        # ignore_eos: the tiny random model may sample its EOS within 3 tokens (it did on an AMD Zen 4)
        json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3, "timeout": 30, "ignore_eos": True}},
        timeout=30,
    )
    assert r.status_code == 200 and json.loads(r.text)["meta_info"]["finish_reason"]["type"] == "length"
