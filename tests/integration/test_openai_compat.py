"""What OpenAI's, SGLang's and vLLM's clients rely on, through the real server (issue 37): default
lengths, usage, stream chunks, model retrieval, the peers' extra fields, and lengths beyond the
context."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.server_harness import gen

CTX = 1024  # the integration server's --context-length
HI = [{"role": "user", "content": "hi"}]
UNIT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
    },
}


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def _tokens(srv, **body) -> list[int]:
    r = _post(srv, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _events(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


# -- 1. default lengths ---------------------------------------------------------------------------------
def test_chat_without_max_tokens_may_use_all_the_context(srv, client):
    r = client.chat.completions.create(model="default", messages=HI, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == CTX, r.usage
    # A forced tool call is not cut mid-JSON at 16 tokens.
    r = client.chat.completions.create(model="default", messages=HI, tools=[UNIT_TOOL], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and r.usage.completion_tokens > 16, (choice, r.usage)
    assert json.loads(choice.message.tool_calls[0].function.arguments)["unit"] in ("c", "f")
    # Legacy completions keep OpenAI's default of 16, as SGLang and vLLM do.
    c = client.completions.create(model="default", prompt="hi", extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 16 and c.choices[0].finish_reason == "length"


# -- 2. usage -------------------------------------------------------------------------------------------
def test_prompt_tokens_count_once_per_prompt_whatever_n(srv, client):
    prompt = "The capital of France is"
    p = len(_tokens(srv, prompt=prompt))
    kw = dict(model="default", prompt=[prompt, prompt + " not"], max_tokens=3, n=3, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert len(r.choices) == 6 and r.usage.completion_tokens == 18
    assert r.usage.prompt_tokens == p + len(_tokens(srv, prompt=prompt + " not")), r.usage
    again = client.completions.create(**kw)  # now cached: still at most the prompt, counted once
    assert again.usage.prompt_tokens == r.usage.prompt_tokens
    assert 0 < again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens, again.usage
    m = len(_tokens(srv, messages=HI))
    chat = client.chat.completions.create(model="default", messages=HI, max_tokens=2, n=2,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert chat.usage.prompt_tokens == m and chat.usage.completion_tokens == 4
    # Streamed, the same counts.
    last = _events(srv, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "n": 2, "ignore_eos": True,
                                                  "stream_options": {"include_usage": True}})[-1]  # fmt: skip
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == m
    assert last["usage"]["completion_tokens"] == 4


# -- 3. stream chunks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [True, False])
def test_every_chunk_before_the_last_carries_a_token(srv, chat):
    """Streams with and without logprobs, several choices: no chunk between the role chunk and a
    choice's final one is empty, and each choice ends once."""
    empty, streams = [], 0
    for seed in range(8):
        for logprobs in (True, False):
            body: dict = {"max_tokens": 24, "temperature": 1.0, "seed": seed, "n": 4}
            if chat:
                path, body = "/v1/chat/completions", {**body, "messages": HI, "logprobs": logprobs}
            else:
                path, body = "/v1/completions", {**body, "prompt": f"hello {seed}"}
                body |= {"logprobs": 1} if logprobs else {}
            events = _events(srv, path, body)
            streams += 1
            ends: dict[int, int] = {}
            for k, e in enumerate(events):
                for c in e["choices"]:
                    if c.get("finish_reason") is not None:
                        ends[c["index"]] = ends.get(c["index"], 0) + 1
                        continue
                    if chat and "role" in c["delta"]:
                        continue  # OpenAI's first chunk: the role
                    lp = c["logprobs"]
                    if logprobs:
                        carried = len(lp["content"] if chat else lp["tokens"])
                    else:
                        carried = len((c["delta"].get("content") or "") if chat else c["text"])
                    if not carried:
                        empty.append((path, seed, logprobs, k, c))
            assert ends == {0: 1, 1: 1, 2: 1, 3: 1}, (path, seed, logprobs, ends)
    assert not empty, f"{len(empty)} empty chunks in {streams} streams, e.g. {empty[:3]}"


# -- 4. models ------------------------------------------------------------------------------------------
def test_retrieve_a_model(srv, client):
    listed = client.models.list().data[0]
    for name in (listed.id, "default"):
        m = client.models.retrieve(name)
        assert m.id == listed.id and m.object == "model" and m.owned_by == "kvledger"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "model_not_found"
    assert httpx.get(srv.url + "/v1/models/org/no-such-model").status_code == 404


# -- 8. the peers' extra fields -------------------------------------------------------------------------
def test_matched_stop_and_stop_regex(srv):
    first = _post(srv, "/v1/completions", {"prompt": "Hello there", "max_tokens": 24, "temperature": 0,
                                           "ignore_eos": True}).json()  # fmt: skip
    assert first["choices"][0]["matched_stop"] is None  # ended by length
    ids = gen(srv, {"text": "Hello there", "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                              "ignore_eos": True}}).json()["output_ids"]  # fmt: skip
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    r = _post(srv, "/v1/completions", {"prompt": "Hello there", "max_tokens": 24, "temperature": 0,
                                       "ignore_eos": True, "stop_token_ids": [ids[k]]}).json()  # fmt: skip
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == ids[k] and r["usage"]["completion_tokens"] == k + 1
    # stop_regex: the first two printable characters not seen before end the text, cut before them;
    # matched_stop is the pattern (SGLang's: which stop ended it), not the text it matched.
    text = first["choices"][0]["text"]
    at = next(i for i in range(2, len(text) - 1) if text[i : i + 2].isalnum() and text[i : i + 2] not in text[: i + 1])
    pattern = f"{re.escape(text[at : at + 2])}|@@@"
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": [pattern]}
    r = _post(srv, "/v1/completions", {"prompt": "Hello there", **body}).json()["choices"][0]
    assert (r["finish_reason"], r["matched_stop"], r["text"]) == ("stop", pattern, text[:at])
    chat = _post(srv, "/v1/chat/completions", {"messages": HI, "stop_token_ids": [ids[k]], "max_tokens": 24,
                                               "temperature": 0}).json()  # fmt: skip
    assert "matched_stop" in chat["choices"][0]
    last = [e for e in _events(srv, "/v1/completions", {"prompt": "Hello there", **body}) if e["choices"]][-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["matched_stop"] == pattern


def test_continuous_usage_stats(srv):
    m = len(_tokens(srv, messages=HI))
    events = _events(srv, "/v1/chat/completions", {"messages": HI, "max_tokens": 6, "ignore_eos": True,
                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert all(e["usage"]["prompt_tokens"] == m for e in events)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6, counts
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


def test_continue_final_message(srv):
    msgs = [*HI, {"role": "assistant", "content": "Hello wor"}]
    cont = _tokens(srv, messages=msgs, continue_final_message=True)
    detok = _post(srv, "/detokenize", {"tokens": cont}).json()["prompt"]
    assert detok.endswith("Hello wor"), detok  # no end of turn, no new assistant turn
    assert cont != _tokens(srv, messages=msgs)
    r = _post(srv, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True, "max_tokens": 3,
                                            "add_generation_prompt": False})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(cont), r.text
    for bad in ({"messages": HI, "continue_final_message": True},
                {"messages": msgs, "continue_final_message": True, "add_generation_prompt": True}):  # fmt: skip
        r = _post(srv, "/v1/chat/completions", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_cache_salt_isolates_the_prefix_cache(srv):
    """Requests with different salts never share cached KV; the same salt does (vLLM's cache_salt,
    SGLang's extra_key). The ledger is audited clean after (the srv fixture)."""
    assert httpx.post(srv.url + "/flush_cache").status_code == 200
    prompt = "z" * 300

    def cached(**kw) -> int:
        r = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 250
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0 and cached(extra_key="tenant-a") == 0
    assert cached(cache_salt="tenant-b") > 250 and cached() > 250
    native = gen(srv, {"text": prompt, "cache_salt": "tenant-a", "sampling_params": {"max_new_tokens": 1}})
    assert native.json()["meta_info"]["cached_tokens"] > 250
    r = _post(srv, "/v1/completions", {"prompt": prompt, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_peer_fields_are_implemented_or_refused_and_unknown_ones_logged(srv):
    body = {"messages": HI, "max_tokens": 2}
    for name, value in (("logit_bias", {"5": 10}), ("use_beam_search", True), ("chat_template", "{{ x }}"),
                        ("echo", True), ("prompt_logprobs", 1), ("lora_path", "x")):  # fmt: skip
        r = _post(srv, "/v1/chat/completions", {**body, name: value})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == name and r.json()["error"]["code"] == "unsupported_parameter"
        # Sent with its default it asks for nothing, and is accepted.
    for name, value in (("logit_bias", None), ("use_beam_search", False), ("echo", False), ("lora_path", None)):
        assert _post(srv, "/v1/chat/completions", {**body, name: value}).status_code == 200, name
    # The same inside messages: OpenAI's deprecated function_call is refused, reasoning is rendered.
    said = {"role": "assistant", "content": "ok", "function_call": {"name": "f", "arguments": "{}"}}
    r = _post(srv, "/v1/chat/completions", {**body, "messages": [*HI, said, *HI]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "function_call", r.text
    said = {"role": "assistant", "content": "ok", "reasoning_content": "hm", "refusal": None}
    assert _post(srv, "/v1/chat/completions", {**body, "messages": [*HI, said, *HI]}).status_code == 200
    r = _post(srv, "/generate", {"text": "x", "return_hidden_states": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states"
    r = _post(srv, "/v1/chat/completions", {**body, "zzz_unknown_field": 1, "min_tokens": 2,
                                            "skip_special_tokens": False, "user": "me"})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert "zzz_unknown_field" in srv.logs()


def test_without_a_reasoning_parser_as_sglang_without_one(srv, client):
    """SGLang's test_reasoning_content (its server without --reasoning-parser) through the openai SDK:
    separate_reasoning / stream_reasoning change nothing there, whatever their value, and every message
    and delta carries reasoning_content null, which its clients read (the SDK raises AttributeError
    for a field the answer lacks)."""
    for extra in ({"separate_reasoning": False}, {"separate_reasoning": True, "stream_reasoning": False}):
        r = client.chat.completions.create(model="default", messages=HI, max_tokens=3, extra_body=extra)
        assert r.choices[0].message.reasoning_content is None
        chunks = client.chat.completions.create(model="default", messages=HI, max_tokens=3, stream=True, extra_body=extra)
        deltas = [c.choices[0].delta for c in chunks]
        assert deltas[0].role == "assistant" and all(d.reasoning_content is None for d in deltas)
    # The same beside tool calls (their own chunks).
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="default", messages=HI, tools=[UNIT_TOOL], tool_choice=forced)
    assert r.choices[0].message.tool_calls and r.choices[0].message.reasoning_content is None
    chunks = client.chat.completions.create(
        model="default", messages=HI, tools=[UNIT_TOOL], tool_choice=forced, stream=True
    )
    deltas = [c.choices[0].delta for c in chunks]
    assert any(d.tool_calls for d in deltas) and all(d.reasoning_content is None for d in deltas)
    # include_reasoning: false asks for the reasoning to be dropped, which takes a parser: refused.
    r = _post(srv, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "include_reasoning": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning", r.text


# -- 9. lengths beyond the context ----------------------------------------------------------------------
def test_max_tokens_beyond_the_context_is_a_400_with_the_numbers(srv, client):
    m = len(_tokens(srv, messages=HI))
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="default", messages=HI, **{field: CTX})
        err = e.value.response.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == field
        assert err["message"].startswith(
            f"This model's maximum context length is {CTX} tokens. However, you requested {m + CTX} tokens "
            f"({m} in the messages, {CTX} in the completion)."
        ), err
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=CTX - m, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == CTX - m  # exactly what fits is fine
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="hi", max_tokens=CTX)
    r = gen(srv, {"text": "hi", "sampling_params": {"max_new_tokens": CTX}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens"
    assert "in the completion" in r.json()["error"]["message"]
