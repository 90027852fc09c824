"""Tool calling through the real server with openai-python: a call -> tool result -> answer round
trip on SmolLM2, streamed and not; forced choices; pydantic tools (their $defs); parallel calls
(OpenAI's parallel_tool_calls) whole and streamed, on the tiny random model, whose noisy calls
exercise the grammar; bad tool specs and schemas as 400s that keep the connection."""

from __future__ import annotations

import enum
import http.client
import json
import urllib.parse

import httpx
import jsonschema
import openai
import pydantic
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
        max_tokens=160,
    )
    done = c.chat.completions.create(**kw)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls  # required: one or more (SmolLM2 asks for both units)
    assert calls and len({call.id for call in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), params)
    # The same request streamed gives the same calls (greedy), as argument deltas.
    content, streamed_calls, finish = streamed(c, **kw)
    assert finish == "tool_calls" and not content.strip()
    assert [(x["name"], json.loads(x["arguments"])) for x in streamed_calls] == [
        (call.function.name, json.loads(call.function.arguments)) for call in calls
    ]
    # With parallel_tool_calls false, exactly one: the first of them.
    [one] = c.chat.completions.create(parallel_tool_calls=False, **kw).choices[0].message.tool_calls
    assert (one.function.name, one.function.arguments) == (calls[0].function.name, calls[0].function.arguments)
    # Each tool's result goes back in a role "tool" message; the model answers in text.
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump() for call in calls]},
        *(
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21, "sky": "sunny"})}
            for call in calls
        ),
    ]
    answer = c.chat.completions.create(
        model="default", messages=history, tools=[WEATHER, TIME], temperature=0, max_tokens=40
    )
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens > done.usage.prompt_tokens  # the calls and results are in the prompt
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


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(pydantic.BaseModel):
    city: str
    country: str


class GetForecast(pydantic.BaseModel):
    """The weather forecast for a place."""

    place: Place
    unit: Unit
    days: int = pydantic.Field(ge=1, le=7)


def test_pydantic_tool_with_defs_under_required_and_named(smol_server):
    """openai.pydantic_function_tool's parameters use $defs/$ref, as response_format's do."""
    c = client(smol_server)
    tool = openai.pydantic_function_tool(GetForecast)
    assert "$defs" in tool["function"]["parameters"]
    ask = [{"role": "user", "content": "What will the weather be in Oslo, Norway for 3 days, in celsius?"}]
    for choice in ("required", {"type": "function", "function": {"name": "GetForecast"}}):
        kw = dict(model="default", messages=ask, tools=[tool], tool_choice=choice, temperature=0, max_tokens=150)
        done = c.chat.completions.parse(**kw)
        choice_ = done.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_
        calls = choice_.message.tool_calls
        assert calls and all(isinstance(x.function.parsed_arguments, GetForecast) for x in calls)
        _, streamed_calls, finish = streamed(c, **kw)
        assert finish == "tool_calls"
        assert [(x["name"], json.loads(x["arguments"])) for x in streamed_calls] == [
            (x.function.name, json.loads(x.function.arguments)) for x in calls
        ]
    smol_server.wait_idle_clean()


PICK = {
    "type": "function",
    "function": {"name": "pick", "description": "Pick a digit",
                 "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["n"]}},
}  # fmt: skip
FLIP = {
    "type": "function",
    "function": {"name": "flip", "description": "Flip a coin",
                 "parameters": {"type": "object", "properties": {"side": {"enum": ["heads", "tails"]}},
                                "required": ["side"]}},
}  # fmt: skip


def test_parallel_tool_calls_whole_and_streamed(client):
    """required: one or more calls (several on some seeds), each with its own id; with
    parallel_tool_calls false exactly one. Streamed, each call has its own index, and its first delta
    carries its id and name, the next ones its arguments; the calls are those of the whole answer."""
    params = {"pick": PICK["function"]["parameters"], "flip": FLIP["function"]["parameters"]}
    kw = dict(model="default", messages=[{"role": "user", "content": "Pick a digit and flip a coin."}],
              tools=[PICK, FLIP], tool_choice="required", temperature=1.0, max_tokens=400)  # fmt: skip
    counts = []
    for seed in range(8):
        for parallel in (True, False):
            done = client.chat.completions.create(seed=seed, parallel_tool_calls=parallel, **kw)
            choice = done.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            calls = choice.message.tool_calls
            assert calls and (parallel or len(calls) == 1), calls
            assert len({x.id for x in calls}) == len(calls)
            for x in calls:
                jsonschema.validate(json.loads(x.function.arguments), params[x.function.name])
            counts.append(len(calls))
            deltas, finish = [], None
            for ch in client.chat.completions.create(stream=True, seed=seed, parallel_tool_calls=parallel, **kw):
                if ch.choices:
                    deltas += ch.choices[0].delta.tool_calls or []
                    finish = ch.choices[0].finish_reason or finish
            assert finish == "tool_calls"
            whole = [(x.function.name, x.function.arguments) for x in calls]
            assert [d.index for d in deltas] == [i for i in range(len(whole)) for _ in (0, 1)]
            for i, (name, args) in enumerate(whole):
                head, body = deltas[2 * i], deltas[2 * i + 1]
                assert head.id.startswith("call_") and head.type == "function"
                assert head.function.name == name and head.function.arguments == ""
                assert body.id is None and body.function.name is None and body.function.arguments == args
            assert len({deltas[2 * i].id for i in range(len(whole))}) == len(whole)
    assert max(counts) >= 2, counts  # parallel calls do happen


@pytest.mark.parametrize(
    "schema, code, named",
    [
        ({"type": "object", "properties": {"a": {"type": "wat"}}}, "invalid_grammar", "wat"),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "[unclosed"}}}, "invalid_grammar", "["),
        ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}}, "unsupported_schema", "contains"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zzz"]}, "unsupported_schema", "zzz"),
    ],
)  # fmt: skip
def test_tool_schemas_that_cannot_be_enforced_are_400_and_keep_the_connection(srv, schema, code, named):
    url = urllib.parse.urlsplit(srv.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    bad = {"type": "function", "function": {"name": "broken", "parameters": schema}}
    local = None
    for choice in ("required", {"type": "function", "function": {"name": "broken"}}):
        for stream in (False, True):
            body = {"model": "default", "messages": ASK, "tools": [bad, PICK], "tool_choice": choice,
                    "stream": stream, "max_tokens": 8}  # fmt: skip
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
            r = conn.getresponse()
            err = json.loads(r.read())["error"]
            assert r.status == 400 and (r.getheader("connection") or "").lower() != "close", err
            assert err["code"] == code and err["param"] == "tools.0.function.parameters", err
            assert "broken" in err["message"] and named in err["message"], err
            local = local or conn.sock.getsockname()
            assert conn.sock.getsockname() == local  # the same keep-alive connection throughout
    conn.request("GET", "/v1/models")
    assert conn.getresponse().status == 200 and conn.sock.getsockname() == local
    conn.close()


def test_a_limit_that_cuts_the_calls_reads_length_and_keeps_only_the_complete_calls(client):
    """Issue 56: a forced answer cut by max_tokens said ``finish_reason: "tool_calls"`` and kept the
    cut call's raw markup in ``content`` beside the parsed calls. A limit reads ``length``; the
    complete calls are returned, the cut one dropped, and no markup stays in ``content``, streamed or
    not (the Responses API: ``incomplete``, the same calls)."""
    kw = dict(model="default", messages=[{"role": "user", "content": "Pick a digit and flip a coin."}],
              tools=[PICK, FLIP], tool_choice="required", temperature=1.0)  # fmt: skip
    seed, full = next(
        (s, r) for s in range(16)
        if len((r := client.chat.completions.create(seed=s, max_tokens=400, **kw)).choices[0].message.tool_calls) >= 2
    )  # fmt: skip
    whole = [(x.function.name, x.function.arguments) for x in full.choices[0].message.tool_calls]
    seen = set()
    for cut in range(full.usage.completion_tokens - 1, 0, -1):
        r = client.chat.completions.create(seed=seed, max_tokens=cut, **kw).choices[0]
        calls = [(x.function.name, x.function.arguments) for x in r.message.tool_calls or []]
        assert r.finish_reason == "length", (cut, r)
        assert calls == whole[: len(calls)], (cut, calls)
        assert not r.message.content, (cut, r.message.content)  # neither the cut call nor the parsed ones
        content, streamed_calls, finish = streamed(client, seed=seed, max_tokens=cut, **kw)
        assert finish == "length" and not content, (cut, content)
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == calls
        seen.add(len(calls))
        if {0, 1} <= seen:
            break
    assert {0, 1} <= seen, seen  # cut inside the first call, and after a complete one
    resp = client.responses.create(model="default", input=kw["messages"], tools=[
        {"type": "function", **t["function"]} for t in (PICK, FLIP)], tool_choice="required",
        temperature=1.0, max_output_tokens=3)  # fmt: skip
    assert resp.status == "incomplete" and resp.output_text == "", resp.output  # no markup: an empty message
