"""The Responses API's conversions (server/responses.py) without a server: input items to chat
messages, the output items and event order a streamed completion builds, the bounded store."""

from __future__ import annotations

import pytest

from kvledger.errors import NotFoundError, ValidationError
from kvledger.server.responses import OutputBuilder
from kvledger.server.responses_input import input_messages, output_messages
from kvledger.server.responses_store import ResponseStore, Stored
from kvledger.server.tools import ToolCall


def test_items_become_chat_messages_with_calls_grouped():
    msgs = input_messages([
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ])  # fmt: skip
    assert msgs[:2] == [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"] and msgs[2]["role"] == "assistant"
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "1"}
    with pytest.raises(ValidationError) as e:
        input_messages([{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}])
    assert e.value.param == "input.0.content.0"


def _stream(builder: OutputBuilder, steps) -> list[dict]:
    events = []
    for text, calls, final in steps:
        events += builder.update(text, calls, final)
    return events


def test_text_then_calls_then_text_are_items_done_in_order():
    b = OutputBuilder()
    call = ToolCall("f", '{"a": 1}')
    events = _stream(b, [("He", None, False), ("Hello", None, False), ("Hello", [call], False),
                         ("Hello\nbye", [call], True)])  # fmt: skip
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    assert [it["type"] for it in b.items] == ["message", "function_call", "message"]
    assert b.items[0]["content"][0]["text"] == "Hello" and b.items[2]["content"][0]["text"] == "bye"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert all(it["status"] == "completed" for it in b.items)
    assert output_messages(b.items) == [
        {"role": "assistant", "content": "Hello", "tool_calls": [
            {"id": b.items[1]["call_id"], "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "assistant", "content": "bye"},
    ]  # fmt: skip


def test_calls_alone_have_no_message():
    b = OutputBuilder()
    b.update("", [ToolCall("f", "{}")], True)
    assert [it["type"] for it in b.items] == ["function_call"]


def test_an_empty_answer_is_one_empty_message():
    b = OutputBuilder()
    events = b.update("", None, True, status="incomplete")
    assert [it["type"] for it in b.items] == ["message"] and b.items[0]["status"] == "incomplete"
    assert "response.output_text.delta" not in [e["type"] for e in events]


def test_the_store_keeps_the_most_recently_used():
    s = ResponseStore(2)
    for rid in ("resp_a", "resp_b", "resp_c"):
        if rid == "resp_c":
            s.get("resp_a", "k")  # a is used: b is the least recently used
        s.put(rid, Stored({"id": rid}, [], "k"))
    assert len(s) == 2 and s.get("resp_a", "k").response == {"id": "resp_a"}
    with pytest.raises(NotFoundError):
        s.get("resp_b", "k")
    s.delete("resp_a", "k")
    with pytest.raises(NotFoundError):
        s.delete("resp_a", "k")
    with pytest.raises(ValidationError):  # not a response id at all: a 400, not a 404
        s.get("a", "k")


def test_a_stored_response_is_its_creators_alone():
    """Another key's lookup, follow-up or delete finds nothing (issue 50: a second tenant read a
    stored response by its id), with an unknown id's own 404."""
    s = ResponseStore(4)
    s.put("resp_a", Stored({"id": "resp_a"}, [{"role": "user", "content": "secret"}], "tenant-a"))
    for call in (lambda: s.get("resp_a", "tenant-b"), lambda: s.delete("resp_a", "tenant-b")):
        with pytest.raises(NotFoundError) as e:
            call()
        assert "no stored response" in e.value.message
    assert s.get("resp_a", "tenant-a").conversation[0]["content"] == "secret"


def test_reasoning_is_an_item_before_the_answer():
    """With a reasoning parser: OpenAI's reasoning item (summary empty, the text as reasoning_text
    content) streamed before the message, done before it opens; given back as reasoning_content."""
    b = OutputBuilder()
    events = []
    for kw in (dict(text="", thought="W"), dict(text="", thought="Why"), dict(text="", thought="Why", thought_done=True),
               dict(text="O", thought="Why", thought_done=True),
               dict(text="OK", thought="Why", thought_done=True, final=True)):  # fmt: skip
        events += b.update(kw.pop("text"), None, kw.pop("final", False), **kw)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
    ]  # fmt: skip
    assert [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"] == ["W", "hy"]
    r, m = b.items
    assert r["type"] == "reasoning" and r["summary"] == [] and r["status"] == "completed"
    assert r["content"] == [{"type": "reasoning_text", "text": "Why"}] and m["content"][0]["text"] == "OK"
    assert output_messages(b.items) == [{"role": "assistant", "content": "OK", "reasoning_content": "Why"}]
    # ... and an input reasoning item sent back reaches the next assistant message the same way.
    items = [{"role": "user", "content": "q"}, r, {"type": "message", "role": "assistant", "content": "OK"}]
    back = input_messages(items, reasoning=True)
    assert back[1] == {"role": "assistant", "content": "OK", "reasoning_content": "Why"}
    with pytest.raises(ValidationError) as e:
        input_messages([{"type": "reasoning", "content": "Why"}], reasoning=True)
    assert e.value.param == "input.0.content"
    with pytest.raises(ValidationError) as e:  # a server without a reasoning parser has none to take back
        input_messages(items)
    assert e.value.param == "input.1.type" and "--reasoning-parser" in e.value.message


def test_reasoning_cut_off_is_the_only_item():
    b = OutputBuilder()
    b.update("", None, True, status="incomplete", thought="Wh", thought_done=True)
    assert [it["type"] for it in b.items] == ["reasoning"]
    assert output_messages(b.items) == [{"role": "assistant", "content": "", "reasoning_content": "Wh"}]
