"""Priorities over HTTP, with the real server and the real openai client: the ``priority`` field on
/generate, /v1/completions, /v1/chat/completions and /v1/responses; a high-priority arrival preempting
a running request whose output is then the same as alone (fp32, greedy); a wrong type is a 400 in the
OpenAI error shape; without --enable-priority-scheduling the field is ignored (SGLang's default)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.integration.conftest import started_server

LOW = {"input_ids": [7] * 20, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def prio_server(chat_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "priority.log")
    yield from started_server(chat_model, log, "--max-running-requests", "1", "--enable-priority-scheduling")


@pytest.fixture
def psrv(prio_server):
    yield prio_server
    prio_server.wait_idle_clean()


def _running_rids(srv) -> int:
    m = srv.info()["memory"]
    return m["req_slots_total"] - m["req_slots_free"]


def test_high_priority_preempts_and_the_preempted_output_is_unchanged(psrv):
    alone = httpx.post(psrv.url + "/generate", json=LOW, timeout=120).json()["output_ids"]

    async def main():
        oc = openai.AsyncOpenAI(base_url=psrv.url + "/v1", api_key="none", max_retries=0)
        async with httpx.AsyncClient(base_url=psrv.url, timeout=120) as c:
            low = asyncio.create_task(c.post("/generate", json={**LOW, "priority": 0, "rid": "low"}))
            for _ in range(500):
                await asyncio.sleep(0.01)
                if _running_rids(psrv):
                    break
            # The only slot is taken: without preemption this would wait for all 200 tokens of "low".
            high = await oc.completions.create(
                model="default", prompt=[5] * 8, max_tokens=3, temperature=0, extra_body={"priority": 50}
            )
            assert high.choices[0].finish_reason == "length"
            assert not low.done()  # the preempted request is still to finish
            r = await low
        await oc.close()
        return r

    r = asyncio.run(main())
    assert r.status_code == 200
    assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert r.json()["output_ids"] == alone
    assert "kvledger_preemptions 1.0" in httpx.get(psrv.url + "/metrics").text


def test_priority_on_every_generation_endpoint(psrv):
    client = openai.OpenAI(base_url=psrv.url + "/v1", api_key="none", max_retries=0)
    r = httpx.post(psrv.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}, "priority": 3})
    assert r.status_code == 200, r.text
    assert client.completions.create(model="default", prompt="x", max_tokens=2, extra_body={"priority": -4}).choices
    assert client.chat.completions.create(model="default", messages=HI, max_tokens=2, extra_body={"priority": 7}).choices
    out = client.responses.create(model="default", input="hi", max_output_tokens=2, extra_body={"priority": 1})
    assert out.status in ("completed", "incomplete")


@pytest.mark.parametrize("value", ["high", 1.5, True, 2**63, None])
def test_wrong_priority_type_is_a_400_in_the_openai_shape(psrv, value):
    bodies = {
        "/generate": {"text": "x", "sampling_params": {"max_new_tokens": 2}},
        "/v1/completions": {"prompt": "x", "max_tokens": 2},
        "/v1/chat/completions": {"messages": HI, "max_tokens": 2},
        "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    }
    before = psrv.info()["memory"]
    for path, body in bodies.items():
        r = httpx.post(psrv.url + path, json={**body, "priority": value}, timeout=60)
        if value is None:  # null: no priority, accepted
            assert r.status_code == 200, (path, r.text)
            continue
        assert r.status_code == 400, (path, value, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["param"].startswith("priority"), (path, err)
    if value is not None:
        assert psrv.info()["memory"]["kv_private"] == before["kv_private"] == 0


def test_priority_is_ignored_without_priority_scheduling(srv, client):
    """SGLang's default without --enable-priority-scheduling: the field is accepted and changes nothing."""
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=2, extra_body={"priority": 99})
    assert r.choices[0].finish_reason in ("length", "stop")
    r = httpx.post(srv.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}, "priority": 1})
    assert r.status_code == 200, r.text
