"""Tool-call formats: written and parsed back, partial markers held back while streaming, complete
calls reported as they end; bad tool specs refused; the tool-call grammars (OpenAI's tool_choice and
parallel_tool_calls) admit exactly the calls allowed; tool schemas with $defs, or that do not
compile, or with keywords that are not enforced."""

from __future__ import annotations

import enum
import json

import openai
import pydantic
import pytest

from kvledger.errors import ValidationError
from kvledger.server.tool_grammar import tool_call_grammar
from kvledger.server.tool_requests import check_tools, render_messages
from kvledger.server.tools import PARSERS, make_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize("name", sorted(set(PARSERS) - {"qwen", "qwen25"}))
def test_calls_round_trip_through_each_format(name):
    p = make_parser(name)
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    text = "Let me check. " + p.format_calls(calls)
    content, parsed = p.split(text, final=True)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    # Streaming: a partial marker is held back; each call is reported once complete, the rest waits.
    assert p.split("Let me check. " + p.start[:3], final=False) == ("Let me check. ", None)
    first = text.index(p.start) + len(p.format_call(*calls[0])) - len(p.list_close)
    assert p.split(text[: first - 1], final=False) == ("Let me check.", None)
    content, parsed = p.split(text[: first + 2], final=False)
    assert content == "Let me check." and [c.name for c in parsed] == ["get_weather"]
    half = text[: len(text) - 5]
    content, parsed = p.split(half, final=False)
    assert content == "Let me check." and [c.name for c in parsed] == ["get_weather"]
    # At the end, what is not a complete call is content: an unfinished call is shown as text, and a
    # call already streamed stays a call.
    content, parsed = p.split(half, final=True)
    assert [c.name for c in parsed] == ["get_weather"]
    assert content.startswith("Let me check.\n") and half.endswith(content.split("\n", 1)[1])
    unfinished = "Let me check. " + p.format_call("get_time", {})[:-3]
    assert p.split(unfinished, final=True) == (unfinished, None)
    assert p.split("no calls here", final=True) == ("no calls here", None)


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([], "auto", "tools"),
        ([{"type": "function"}], "auto", "tools.0"),
        ([{"type": "function", "function": {"name": ""}}], "auto", "tools.0.function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "auto",
            "tools.0.function.parameters",
        ),
        ([WEATHER, WEATHER], "auto", "tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_bad_tools_are_400(tools, choice, param):
    with pytest.raises(ValidationError) as e:
        check_tools(tools, choice)
    assert e.value.param == param


def test_choices():
    assert check_tools([WEATHER], None) == ([WEATHER], None)
    assert check_tools([WEATHER], "none") == ([], None)
    assert check_tools([WEATHER, TIME], "required") == ([WEATHER, TIME], "*")
    assert (
        check_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})[1] == "get_time"
    )


@pytest.fixture(scope="module")
def admits(tiny_chat_tokenizer):
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tiny_chat_tokenizer, vocab_size=260))

    def admits(ebnf: str, text: str) -> bool:
        m = xgr.GrammarMatcher(compiler.compile_grammar(ebnf))
        return m.accept_string(text) and m.is_completed()

    return admits


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_tool_call_grammars_follow_tool_choice_and_parallel_tool_calls(name, admits):
    p = make_parser(name)
    weather, time = ("get_weather", {"city": "Oslo"}), ("get_time", {})
    one, two, three = p.format_calls([weather]), p.format_calls([weather, time]), p.format_calls([time] * 3)
    # required: one or more calls of any tool; with parallel_tool_calls false, exactly one.
    required = tool_call_grammar(p, [WEATHER, TIME], "*", parallel=True)
    assert admits(required, one) and admits(required, two) and admits(required, three)
    assert not admits(required, "") and not admits(required, "Sure! " + one)
    assert not admits(required, p.format_calls([("get_weather", {"town": "Oslo"})]))
    single = tool_call_grammar(p, [WEATHER, TIME], "*", parallel=False)
    assert admits(single, one) and admits(single, p.format_calls([time])) and not admits(single, two)
    # A named function: exactly one call of it, parallel or not.
    for parallel in (True, False):
        named = tool_call_grammar(p, [WEATHER, TIME], "get_weather", parallel=parallel)
        assert admits(named, one) and not admits(named, p.format_calls([time]))
        assert not admits(named, p.format_calls([weather, weather]))
    # auto: free with parallel calls; without, any text and at most one call, which ends the answer.
    assert tool_call_grammar(p, [WEATHER, TIME], None, parallel=True) is None
    auto = tool_call_grammar(p, [WEATHER, TIME], None, parallel=False)
    assert admits(auto, "No call needed.") and admits(auto, "Let me look. " + one)
    assert not admits(auto, two) and not admits(auto, one + " Done.")


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(pydantic.BaseModel):
    city: str
    country: str


class GetForecast(pydantic.BaseModel):
    place: Place
    unit: Unit
    days: int = pydantic.Field(ge=1, le=7)


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_pydantic_tool_schemas_with_defs_are_enforced(name, admits):
    """openai.pydantic_function_tool's parameters use $defs/$ref: "#/$defs/Place" must still resolve."""
    tool = openai.pydantic_function_tool(GetForecast)
    assert "$defs" in tool["function"]["parameters"]
    p = make_parser(name)
    good = {"place": {"city": "Oslo", "country": "NO"}, "unit": "celsius", "days": 3}
    for forced in ("*", "GetForecast"):
        g = tool_call_grammar(p, [tool, WEATHER], forced, parallel=True)
        assert admits(g, p.format_calls([("GetForecast", good)]))
        assert not admits(g, p.format_calls([("GetForecast", {**good, "unit": "kelvin"})]))
        assert not admits(g, p.format_calls([("GetForecast", {**good, "place": {"city": "Oslo"}})]))


@pytest.mark.parametrize(
    "schema, code, named",
    [
        ({"type": "object", "properties": {"a": {"type": "wat"}}}, "invalid_grammar", "wat"),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "[unclosed"}}}, "invalid_grammar", "["),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}, "invalid_grammar", "$defs"),
        ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}}, "unsupported_schema", "contains"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zzz"]}, "unsupported_schema", "zzz"),
    ],
)  # fmt: skip
def test_tool_schemas_that_cannot_be_enforced_are_400_naming_the_tool(schema, code, named):
    bad = {"type": "function", "function": {"name": "broken", "parameters": schema}}
    for forced, parallel in (("*", True), ("broken", True), (None, False)):
        with pytest.raises(ValidationError) as e:
            tool_call_grammar(make_parser("hermes"), [WEATHER, bad], forced, parallel=parallel)
        err = e.value
        assert err.status == 400 and err.code == code and err.param == "tools.1.function.parameters"
        assert "broken" in err.message and named in err.message, err.message
    # auto with parallel calls constrains nothing, so it checks nothing.
    assert tool_call_grammar(make_parser("hermes"), [WEATHER, bad], None, parallel=True) is None


def test_rendering_without_template_support_adds_the_tools_and_writes_calls_as_text():
    p = make_parser("hermes")
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"celsius": 21}'},
    ]  # fmt: skip
    out = render_messages(msgs, [WEATHER], p, template_has_tools=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[2]["content"] == p.format_call("get_weather", {"city": "Paris"})
    assert out[3] == msgs[2]
    kept = render_messages(msgs, [WEATHER], p, template_has_tools=True)
    assert kept[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_llama3_python_tag_is_not_content():
    p = make_parser("llama3")
    content, calls = p.split('<|python_tag|>{"name": "get_time", "parameters": {}}', final=True)
    assert content == "" and [c.name for c in calls] == ["get_time"]
