"""Tool-call formats: written and parsed back, partial markers held back while streaming, bad tool
specs refused, forced-choice grammars that admit exactly the call."""

from __future__ import annotations

import json

import pytest

from kvledger.errors import ValidationError
from kvledger.server.tools import PARSERS, check_tools, forced_grammar, make_parser, render_messages

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
    # Streaming: before the calls are complete nothing is parsed, and a partial marker is held back.
    assert p.split("Let me check. " + p.start[:3], final=False) == ("Let me check. ", None)
    half = text[: len(text) - 5]
    assert p.split(half, final=False) == ("Let me check.", None)
    assert p.split(half, final=True) == (half, None)  # unfinished at the end: shown as text
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


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_forced_grammar_admits_the_call_and_nothing_else(name, tiny_chat_tokenizer):
    import xgrammar as xgr

    p = make_parser(name)
    info = xgr.TokenizerInfo.from_huggingface(tiny_chat_tokenizer, vocab_size=260)
    compiler = xgr.GrammarCompiler(info)

    def admits(ebnf: str, text: str) -> bool:
        m = xgr.GrammarMatcher(compiler.compile_grammar(ebnf))
        return m.accept_string(text) and m.is_completed()

    g = forced_grammar(p, [WEATHER, TIME], "get_weather")
    good = p.format_calls([("get_weather", {"city": "Oslo"})])
    assert admits(g, good)
    assert not admits(g, p.format_calls([("get_time", {})]))
    assert not admits(g, "Sure! " + good)
    anyone = forced_grammar(p, [WEATHER, TIME], "*")
    assert admits(anyone, p.format_calls([("get_time", {})]))


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
