"""The real server with NGRAM speculation: output equals the plain offline engine's, streamed events
carry several tokens when drafts are accepted, /health_generate and a dropped stream leak nothing,
the metrics and meta fields are there, and the books are clean after each test."""

from __future__ import annotations

import itertools
import json

import httpx
import openai
import pytest

from tests.integration.conftest import started_server

G = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 48}
PROMPT = [40, 41, 42, 43, 44] * 6


@pytest.fixture(scope="module")
def spec_server(chat_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "spec.log")
    yield from started_server(
        chat_model, log, "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"
    )


@pytest.fixture
def srv(spec_server):
    yield spec_server
    spec_server.wait_idle_clean()


def test_output_equals_plain_engine_and_streams_several_tokens(srv, chat_model):
    from kvledger import Engine

    plain = Engine(chat_model, dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    ref = plain.generate(input_ids=PROMPT, sampling_params=G)["output_ids"]
    r = httpx.post(srv.url + "/generate", json={"input_ids": PROMPT, "sampling_params": G}, timeout=60)
    assert r.status_code == 200 and r.json()["output_ids"] == ref
    meta = r.json()["meta_info"]
    assert 0 < meta["spec_verify_ct"] < len(ref) and meta["spec_accept_length"] > 1
    body = {"input_ids": PROMPT, "sampling_params": G, "stream": True}
    with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as resp:
        events = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    sizes = [len(e["output_ids"]) for e in events]
    assert events[-1]["output_ids"] == ref and sizes == sorted(sizes)
    assert any(b - a > 1 for a, b in itertools.pairwise(sizes))  # accepted drafts arrive together
    metrics = httpx.get(srv.url + "/metrics").text
    assert "kvledger_spec_accept_length_count" in metrics and "kvledger_spec_accept_length_mean" in metrics
    assert plain.audit().ok


def test_openai_client_and_health_generate(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    full = client.completions.create(model="default", prompt=PROMPT, max_tokens=30, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="default", prompt=PROMPT, max_tokens=30, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == full.choices[0].text
    for _ in range(5):
        assert httpx.get(srv.url + "/health_generate", timeout=30).status_code == 200


def test_dropped_stream_mid_speculation_leaks_nothing(srv):
    body = {"input_ids": PROMPT, "sampling_params": {**G, "max_new_tokens": 900}, "stream": True}
    with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as resp:
        for ln in resp.iter_lines():
            if ln.startswith("data: {") and len(json.loads(ln[6:])["output_ids"]) > 20:
                break  # the client goes away in the middle of verify steps
        else:
            pytest.fail("the stream ended before 20 tokens: the disconnect never happened mid-speculation")
