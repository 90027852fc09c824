"""The real server on loopback, driven with the `openai` client and httpx: the happy paths."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import re
import time

import httpx

from tests.server_harness import gen

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


def test_streamed_chunks_never_split_a_character(srv, client):
    """The tiny model's tokens are single bytes, so every character below is two to four tokens: each
    streamed chunk must end on a character boundary (the detokenizer holds the rest back)."""
    regex = "(é|ü|中|🤖){5}"
    kw = dict(model="default", prompt="Say it:", max_tokens=40, temperature=1.0, seed=3, extra_body={"regex": regex})
    full = client.completions.create(**kw).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices]
    assert re.fullmatch(regex, full), full
    assert "".join(chunks) == full
    assert len([c for c in chunks if c]) > 1 and all("\ufffd" not in c for c in chunks), chunks


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
    card = httpx.get(srv.url + "/v1/models").json()["data"][0]
    # `root` is the served name, never the model's path on the server's disk (issue 56).
    assert card["max_model_len"] == 1024 and card["root"] == card["id"] and card["parent"] is None
    assert srv.model not in httpx.get(srv.url + "/v1/models").text


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


def test_tokenize_and_detokenize(srv, tiny_chat_tokenizer):
    r = httpx.post(srv.url + "/tokenize", json={"model": "default", "prompt": "Hello there"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tiny_chat_tokenizer.encode("Hello there") and body["count"] == len(
        body["tokens"]
    )
    assert body["max_model_len"] == 1024
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(srv.url + "/tokenize", json={"messages": msgs}).json()
    templated = tiny_chat_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert chat["tokens"] == list(templated)
    back = httpx.post(srv.url + "/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == "Hello there"
    assert httpx.post(srv.url + "/detokenize", json={"tokens": []}).json()["prompt"] == ""
    for path, bad, status in (
        ("/tokenize", {}, 400),
        ("/tokenize", {"prompt": "x", "messages": msgs}, 400),
        ("/tokenize", {"prompt": 5}, 400),
        ("/tokenize", {"prompt": "x", "model": "nope"}, 404),
        ("/detokenize", {"tokens": [1, 99999]}, 400),
        ("/detokenize", {"tokens": ["a"]}, 400),
        ("/detokenize", {}, 400),
    ):
        r = httpx.post(srv.url + path, json=bad)
        assert r.status_code == status, (path, bad, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_what_the_router_calls(srv):
    """SGLang's router registers a worker with /health, /server_info and /model_info, and polls
    /get_load; the old names work too. Its injected bootstrap fields are accepted."""
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(srv.url + path).json()
        assert info["model_path"] and info["served_model_name"] and "memory" in info
    for path in ("/model_info", "/get_model_info"):
        mi = httpx.get(srv.url + path).json()
        assert mi["is_generation"] is True and mi["model_type"] == "llama"
        assert mi["architectures"] == ["LlamaForCausalLM"] and mi["model_path"]
    idle = httpx.get(srv.url + "/get_load").json()
    assert [{k: v for k, v in r.items() if k != "ts_tic"} for r in idle] == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]
    # While requests run, the router sees them and their tokens (the figures are at most 0.1 s old;
    # eight requests of 300 tokens keep the server busy for seconds: each step checks the books).
    body = {"input_ids": [3, 4, 5, 6], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # (the client waits up to 300 s: on a box loaded by other jobs, 1,000 tokens each once took
        # longer than gen's 60 s)
        futures = [pool.submit(httpx.post, srv.url + "/generate", json=body, timeout=300) for _ in range(8)]
        deadline = time.monotonic() + 10
        while (load := httpx.get(srv.url + "/get_load").json())[0]["num_reqs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(f.result().status_code == 200 for f in futures)
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] >= 1 and load[0]["num_tokens"] >= 5, load
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": None, "bootstrap_room": 12345}  # fmt: skip
    assert gen(srv, body).status_code == 200


# -- cross-site requests ------------------------------------------------------------------------------


def test_cross_site_posts_are_refused_and_change_nothing(srv):
    """What a web page in an operator's browser can send to a local server without a CORS preflight
    (a form, a text/plain fetch) or with another site's Origin is refused, and changes nothing: a
    refused pause leaves generation running. JSON from the server's own origin, or from no browser,
    works; a POST with no body and no content type (SGLang's router flushing its workers) too."""
    url, own = srv.url, srv.url.replace("localhost", "127.0.0.1")
    pause = b'{"mode": "abort"}'
    try:
        for headers, status, code in [
            ({"content-type": "text/plain"}, 415, "unsupported_media_type"),
            ({"content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
            ({"content-type": "text/plain", "origin": "http://evil.example"}, 403, "cross_origin"),
            ({"content-type": "application/json", "origin": "http://evil.example"}, 403, "cross_origin"),
            ({"content-type": "application/json", "origin": "null"}, 403, "cross_origin"),
            ({"content-type": "application/json", "origin": own.rsplit(":", 1)[0] + ":1"}, 403, "cross_origin"),
        ]:
            r = httpx.post(url + "/pause_generation", content=pause, headers=headers, timeout=30)
            assert r.status_code == status and r.json()["error"]["code"] == code, (headers, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert srv.info()["generation_paused"] is None
        r = gen(srv, {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3  # still generating
    finally:
        httpx.post(url + "/continue_generation", json={}, timeout=30)  # (a broken build paused it)
    # curl -d's default content type is refused with a hint, on every route.
    r = httpx.post(url + "/generate", content=b'{"input_ids": [1]}',
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)  # fmt: skip
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.get(url + "/get_server_info", headers={"origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403
    ok = {"content-type": "application/json; charset=utf-8", "origin": own}
    assert httpx.post(url + "/generate", content=b'{"input_ids": [1, 2]}', headers=ok, timeout=30).status_code == 200
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
