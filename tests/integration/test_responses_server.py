"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) through the real server with
openai-python on the tiny chat model: text, the streamed event sequence, function tools (forced, so
the random model calls them), text.format json_schema, previous_response_id continuing from the
prefix cache, store false, and bad ids, inputs and peer fields as 4xx in the OpenAI error shape."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

PICK = {"type": "function", "name": "pick", "description": "Pick a digit",
        "parameters": {"type": "object", "properties": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["digit"]}}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}  # fmt: skip
# Output that cannot end early (the random model may end any answer at once): a string of 600 or more.
ENDLESS = {"format": {"type": "json_schema", "name": "long",
                      "schema": {"type": "object", "properties": {"s": {"type": "string", "minLength": 600}},
                                 "required": ["s"]}}}  # fmt: skip
LONG = "Tell me a long story about the sea, the ships, the stars and the harbour lights at night. " * 3


def test_text_response_shape_usage_and_retrieve(client):
    r = client.responses.create(model="default", input="Say hello.", instructions="Be brief.",
                                max_output_tokens=6, temperature=0)  # fmt: skip
    assert r.id.startswith("resp_") and r.object == "response" and r.model
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text
    u = r.usage
    assert 0 < u.output_tokens <= 6 and u.input_tokens > 5 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    client.responses.delete(again.id)
    for forget in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            forget(r.id)
    # The same request through chat/completions: the same prompt (instructions are the system message).
    chat = client.chat.completions.create(model="default", max_tokens=6, temperature=0,
                                          messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Say hello."}])  # fmt: skip
    assert chat.usage.prompt_tokens == u.input_tokens and chat.choices[0].message.content == r.output_text


def test_streamed_event_order_matches_the_whole_answer(client):
    kw = dict(model="default", input=[{"role": "user", "content": [{"type": "input_text", "text": "Count."}]}],
              max_output_tokens=12, temperature=0)  # fmt: skip
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == (
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        + ["response.output_text.delta"] * deltas
        + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
           f"response.{whole.status}"]
    )  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and final.id == events[0].response.id
    with client.responses.stream(**kw) as s:  # the SDK's helper reads the same events
        assert "".join(e.delta for e in s if e.type == "response.output_text.delta") == text
    if whole.status == "completed":  # its final response needs response.completed (not .incomplete)
        with client.responses.stream(**kw) as s:
            assert s.get_final_response().output_text == text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "pick"}])
def test_forced_function_tool_whole_and_streamed(client, choice):
    kw = dict(model="default", input="Pick a digit.", tools=[PICK], tool_choice=choice,
              parallel_tool_calls=False, temperature=0, max_output_tokens=200)  # fmt: skip
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["function_call"], r.output  # no empty message beside it
    [call] = r.output
    assert call.name == "pick" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), PICK["parameters"])
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    i = types.index("response.function_call_arguments.delta")
    assert types[i - 1 : i + 3] == ["response.output_item.added", "response.function_call_arguments.delta",
                                    "response.function_call_arguments.done", "response.output_item.done"]  # fmt: skip
    assert events[i].delta == events[i + 1].arguments == call.arguments
    assert events[i + 2].item.type == "function_call" and events[i + 2].item.name == "pick"
    # The tool's result goes back as a function_call_output item, after the call, by previous_response_id.
    nxt = client.responses.create(model="default", previous_response_id=r.id, max_output_tokens=4, temperature=0,
                                  tools=[PICK], input=[{"type": "function_call_output", "call_id": call.call_id, "output": "7"}])
    assert nxt.status in ("completed", "incomplete") and nxt.previous_response_id == r.id
    # ... or with the whole history as items.
    items = [{"type": "message", "role": "user", "content": "Pick a digit."},
             {"type": "function_call", "call_id": call.call_id, "name": "pick", "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "7"}]  # fmt: skip
    full = client.responses.create(model="default", input=items, tools=[PICK], max_output_tokens=4, temperature=0)
    assert full.usage.input_tokens == nxt.usage.input_tokens  # the same prompt, built from the store
    # ... or with the previous output items given back as input (ids, statuses and all), as the docs do.
    echoed = [items[0], *(o.model_dump(exclude_none=True) for o in r.output), items[2]]
    back = client.responses.create(model="default", input=echoed, tools=[PICK], max_output_tokens=4, temperature=0)
    assert back.usage.input_tokens == full.usage.input_tokens
    assert nxt.usage.input_tokens_details.cached_tokens > 0  # (tools are not carried over: sent again)


def test_text_format_json_schema(client):
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model="default", input="A thing as JSON.", text={"format": fmt},
                                temperature=1.0, max_output_tokens=120)  # fmt: skip
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    obj = client.responses.create(model="default", input="JSON.", text={"format": {"type": "json_object"}},
                                  temperature=1.0, max_output_tokens=200)  # fmt: skip
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_previous_response_id_continues_from_the_prefix_cache(client):
    first = client.responses.create(model="default", input=LONG, max_output_tokens=8, temperature=0)
    follow = "And then?"
    alone = client.responses.create(model="default", input=follow, max_output_tokens=1, temperature=0, store=False)
    second = client.responses.create(model="default", input=follow, previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)  # fmt: skip
    # The prompt is the first turn's conversation (its input and answer) and the new input ...
    assert first.output_text
    history = [{"role": "user", "content": LONG}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": follow}]  # fmt: skip
    replayed = client.responses.create(model="default", input=history, max_output_tokens=1, store=False)
    assert second.usage.input_tokens == replayed.usage.input_tokens
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > alone.usage.input_tokens
    # ... whose beginning, the first prompt, the prefix cache still holds.
    assert second.usage.input_tokens_details.cached_tokens >= 16, second.usage
    third = client.responses.create(model="default", input="Go on.", previous_response_id=second.id,
                                    max_output_tokens=2, temperature=0)  # fmt: skip
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens_details.cached_tokens


def test_store_false_is_not_kept(client):
    r = client.responses.create(model="default", input="hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="default", input="more", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "extra, status, param",
    [
        ({"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"previous_response_id": "bad"}, 400, "previous_response_id"),  # not an id at all (SGLang's test_error)
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0.content.0"),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input.0.type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input.0.role"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, 400, "input.0.call_id"),
        ({"input": 5}, 400, "input"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({"tools": [PICK], "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
        ({"tools": [{**PICK, "parameters": {"type": "object", "properties": {"a": {"type": "wat"}}}}],
          "tool_choice": "required"}, 400, "tools.0.parameters"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, 400, "text.format.schema"),
        ({"input": "x" * 5000}, 400, "input"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"reasoning": {"effort": "high"}}, 400, "reasoning"),
        ({"background": True}, 400, "background"),
        ({"include": ["message.output_text.logprobs"]}, 400, "include"),
        ({"model": "gpt-nothing"}, 404, "model"),
    ],
)  # fmt: skip
def test_bad_requests_are_4xx_in_the_openai_shape(srv, extra, status, param):
    body = {"model": "default", "input": "hi", "max_output_tokens": 2, **extra}
    for stream in (False, True):
        r = httpx.post(srv.url + "/v1/responses", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == status, (extra, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["param"] == param or err["param"].startswith(param + "."), err  # pydantic: "input.str"
    assert httpx.get(srv.url + "/v1/responses/resp_nope").status_code == 404


def test_the_store_is_bounded(chat_model, tmp_path):
    from tests.integration.conftest import started_server

    for s in started_server(chat_model, str(tmp_path / "s.log"), "--max-stored-responses", "2", "--api-key", "k"):
        s.headers = {"Authorization": "Bearer k"}
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0)
        ids = [c.responses.create(model="default", input=f"hi {i}", max_output_tokens=1).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[0])  # the least recently used went first
        assert c.responses.retrieve(ids[2]).id == ids[2]
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.responses.create(model="default", input="hi", max_output_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            bad.responses.retrieve(ids[2])
        s.wait_idle_clean()


def test_a_disconnect_mid_stream_aborts_the_request(srv):
    body = {"model": "default", "input": "hi", "max_output_tokens": 900, "stream": True, "text": ENDLESS}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(ln for ln in lines if ln.startswith("data:") and "output_text.delta" in ln)
        assert _running(srv) == 1
    deadline = time.monotonic() + 2.0
    while _running(srv) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(srv) == 0


def _running(srv) -> int:
    m = srv.info()["memory"]
    return m["req_slots_total"] - m["req_slots_free"]


def test_an_abort_mid_stream_ends_with_error_and_response_failed(srv):
    body = {"model": "default", "input": "hi", "max_output_tokens": 900, "stream": True, "text": ENDLESS}
    events = []
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=30) as r:
        for ln in r.iter_lines():
            if ln.startswith("data:"):
                events.append(json.loads(ln[5:]))
                if events[-1]["type"] == "response.output_text.delta" and len(events) == 5:
                    rid = events[0]["response"]["id"]
                    assert httpx.post(srv.url + "/abort_request", json={"rid": rid}).status_code == 200
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"], events[-3:]
    assert events[-2]["message"] and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == events[-2]["message"]
