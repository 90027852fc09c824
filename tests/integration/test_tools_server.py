"""Tool calling through the real server on SmolLM2 with openai-python: a call -> tool result ->
answer round trip, streamed and not; forced choices; bad tool specs as 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.smollm2

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def streamed(c: openai.OpenAI, **kw) -> tuple[str, list[dict], str]:
    """Accumulate a stream as openai-python's users do: content, calls by index, finish reason."""
    content, calls, finish = "", {}, None
    for ch in c.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_tool_call_round_trip_streamed_and_not(smol_server):
    c = client(smol_server)
    kw = dict(
        model="default",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    done = c.chat.completions.create(**kw)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    # The same request streamed gives the same call (greedy), as argument deltas.
    content, calls, finish = streamed(c, **kw)
    assert finish == "tool_calls" and not content.strip()
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [
        (call.function.name, json.loads(call.function.arguments))
    ]
    # The tool's result goes back in a role "tool" message; the model answers in text.
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21, "sky": "sunny"})},
    ]
    answer = c.chat.completions.create(
        model="default", messages=history, tools=[WEATHER, TIME], temperature=0, max_tokens=40
    )
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens > done.usage.prompt_tokens  # the call and its result are in the prompt
    text, _, fin = streamed(
        c, model="default", messages=history, tools=[WEATHER, TIME], temperature=0, max_tokens=40
    )
    assert fin in ("stop", "length", "tool_calls") and (text or fin == "tool_calls")
    smol_server.wait_idle_clean()


def test_named_choice_and_none(smol_server):
    c = client(smol_server)
    forced = {"type": "function", "function": {"name": "get_time"}}
    done = c.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice=forced,
                                     temperature=0.7, seed=1, max_tokens=60)  # fmt: skip
    [call] = done.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    plain = c.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=20
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in (
        "stop",
        "length",
    )
    smol_server.wait_idle_clean()


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function"}]}, "tools.0"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": "get_weather"}, "tools"),
    ],
)
def test_bad_tools_are_400(smol_server, extra, param):
    r = httpx.post(
        smol_server.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "default", "messages": ASK, **extra},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
