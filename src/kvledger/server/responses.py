"""OpenAI's Responses API on the chat path: its input items, tools, ``tool_choice`` and ``text.format``
converted to chat messages and fields; the output items built from a completion (whole, or as it
streams, with the Responses event sequence); and the bounded store ``previous_response_id`` reads.

A response's conversation (its input, after the previous response's, and its output as assistant
messages) is kept with it, so the next turn's prompt is that conversation plus the new input: the
same tokens the previous prompt began with, which the prefix cache still holds. ``instructions``
are not carried over (OpenAI's rule): each turn's own go first, as a system message.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..errors import NotFoundError, ValidationError
from .tools import ToolCall

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- request -> chat -------------------------------------------------------------------------------------
def _text(content: Any, param: str) -> str:
    """A message's or tool output's content: a string or text parts (``input_text``/``output_text``);
    another kind of part (an image, a file) is refused rather than dropped."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(f"{param} must be a string or a list of text parts", param=param)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValidationError(
                f"{param}[{j}] must be {{\"type\": \"input_text\", \"text\": string}}; this server reads text only",
                param=f"{param}.{j}",
            )
        out.append(part["text"])
    return "".join(out)


def _str_field(item: dict, key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise ValidationError(f"{param}.{key} must be a non-empty string", param=f"{param}.{key}")
    return v


def input_messages(inp: str | list[dict[str, Any]], reasoning: bool = False) -> list[dict[str, Any]]:
    """``input`` (a string, or message / function_call / function_call_output items) as chat messages.
    Function calls after an assistant message (or each other) join it as its ``tool_calls``. With
    ``reasoning`` (a server with a reasoning parser, whose answers have them) reasoning items are
    taken too: the next assistant message's ``reasoning_content``."""
    if isinstance(inp, str):
        if not inp:
            raise ValidationError("input must not be empty", param="input", code="empty_prompt")
        return [{"role": "user", "content": inp}]
    if not inp:
        raise ValidationError("input must not be empty", param="input", code="empty_prompt")
    msgs: list[dict[str, Any]] = []
    thought = None  # a reasoning item's text, given to the assistant message that follows it
    for i, item in enumerate(inp):
        p = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "reasoning" and reasoning:  # an earlier response's reasoning item, sent back
            thought = _reasoning_text(item, p)
            continue
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise ValidationError(f"{p}.role must be one of {', '.join(INPUT_ROLES)}", param=f"{p}.role")
            msgs.append({"role": role, "content": _text(item.get("content"), f"{p}.content")})
        elif kind == "function_call":
            args = item.get("arguments")
            if not isinstance(args, str):
                raise ValidationError(f"{p}.arguments must be a JSON string", param=f"{p}.arguments")
            call = {"id": _str_field(item, "call_id", p), "type": "function",
                    "function": {"name": _str_field(item, "name", p), "arguments": args}}  # fmt: skip
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # the calls of that assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = _text(item.get("output"), f"{p}.output")
            msgs.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", p), "content": out})
        else:
            raise ValidationError(
                f"{p}.type {kind!r} is not supported (message, function_call, function_call_output"
                + (", reasoning)" if reasoning else "; reasoning with --reasoning-parser)"),
                param=f"{p}.type",
                code="unsupported_parameter",
            )
        if thought is not None and msgs[-1]["role"] == "assistant":
            msgs[-1]["reasoning_content"], thought = thought, None
    if thought is not None:
        msgs.append({"role": "assistant", "content": "", "reasoning_content": thought})
    return msgs


def _reasoning_text(item: dict, param: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` content parts (else its summary's texts)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
        isinstance(x, dict) and x.get("type") in ("reasoning_text", "summary_text") and isinstance(x.get("text"), str)
        for x in parts
    ):
        raise ValidationError(
            f"{param}.content must be a list of {{\"type\": \"reasoning_text\", \"text\": string}}",
            param=f"{param}.content",
        )
    return "".join(x["text"] for x in parts)


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Responses' flat function tools (``{type, name, description, parameters, strict}``) in the chat
    shape; other tool types (web search, files, MCP) are refused."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ValidationError(
                f"tools[{i}]: only function tools are supported", param=f"tools.{i}.type", code="unsupported_parameter"
            )
        name = _str_field(t, "name", f"tools.{i}")
        fn = {"name": name, "parameters": t.get("parameters") or {"type": "object"}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``{"type": "function", "name": X}`` -> the chat shape; the strings are the same."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ValidationError(
            "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}", param="tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``: text, json_object, or json_schema (flat here:
    ``{type, name, schema, strict}``)."""
    if text is None or text.get("format") is None:
        return None
    fmt = text["format"]
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ValidationError("text.format.schema must be a JSON schema object", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise ValidationError("text.format.type must be text, json_object or json_schema", param="text.format.type")


# -- the store ---------------------------------------------------------------------------------------------
@dataclass
class Stored:
    """A stored response: its object as answered, and its conversation (without instructions)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    owner: str = ""  # the owner tag of the key that created it (auth.Principal.owner): only it finds it


class ResponseStore:
    """The last ``capacity`` responses created with ``store`` (an LRU: reading one keeps it)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, stored: Stored) -> None:
        if self.capacity <= 0:
            return
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, owner: str, param: str = "previous_response_id") -> Stored:
        """The stored response ``rid`` if ``owner`` created it; to another key it does not exist (the
        same 404 as an unknown id: a tenant never reads, continues or deletes another's)."""
        if not rid.startswith("resp_"):  # not an id this API makes: a malformed value (OpenAI: 400)
            raise ValidationError(f"{param} {rid!r} is not a response id (they begin with 'resp_')", param=param)
        stored = self._items.get(rid)
        if stored is None or stored.owner != owner:
            raise NotFoundError(
                f"no stored response {rid!r} (never stored, store: false, or evicted)", param=param,
                code="response_not_found",
            )  # fmt: skip
        self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str, owner: str) -> None:
        self.get(rid, owner, param="response_id")
        del self._items[rid]


# -- output items and events -----------------------------------------------------------------------------
@dataclass
class OutputBuilder:
    """The output items of one response as its completion grows: a reasoning item first where the
    chat path split reasoning off (``--reasoning-parser``), then a message item for text and a
    function_call item per call, in the order they appear, each done before the next is added (text
    after the calls, which a parser releases at the end, is a second message). ``update`` returns
    the stream events from the last update to this one; the whole answer uses only ``items``."""

    items: list[dict[str, Any]] = field(default_factory=list)
    _message: dict[str, Any] | None = None  # the open message item
    _start: int = 0  # where its text begins in the completion's text
    _shown: int = 0  # the completion's text given out so far
    _calls: int = 0
    _reasoning: dict[str, Any] | None = None  # the open reasoning item
    _thought: str = ""  # its text given out so far
    _thought_closed: bool = False

    def _open_message(self) -> list[dict]:
        self._message = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []}  # fmt: skip
        self._start = self._shown
        self.items.append(self._message)
        i = len(self.items) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            {"type": "response.output_item.added", "output_index": i, "item": copy.deepcopy(self._message)},
            {"type": "response.content_part.added", "item_id": self._message["id"], "output_index": i,
             "content_index": 0, "part": part},
        ]  # fmt: skip

    def _close_message(self, text: str, status: str) -> list[dict]:
        m, i = self._message, self.items.index(self._message)
        done = text[self._start : self._shown]
        part = {"type": "output_text", "text": done, "annotations": [], "logprobs": []}
        m["content"], m["status"] = [part], status
        self._message = None
        return [
            {"type": "response.output_text.done", "item_id": m["id"], "output_index": i, "content_index": 0,
             "text": done, "logprobs": []},
            {"type": "response.content_part.done", "item_id": m["id"], "output_index": i, "content_index": 0,
             "part": part},
            {"type": "response.output_item.done", "output_index": i, "item": copy.deepcopy(m)},
        ]  # fmt: skip

    def _reason(self, thought: str) -> list[dict]:
        """The reasoning item's events for ``thought`` (the reasoning so far): opened at its first
        text, a delta for what is new. OpenAI's shape: ``summary`` empty, the text in ``content``."""
        events: list[dict] = []
        if self._reasoning is None:
            self._reasoning = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                               "status": "in_progress"}  # fmt: skip
            self.items.append(self._reasoning)
            i = len(self.items) - 1
            events += [
                {"type": "response.output_item.added", "output_index": i, "item": copy.deepcopy(self._reasoning)},
                {"type": "response.content_part.added", "item_id": self._reasoning["id"], "output_index": i,
                 "content_index": 0, "part": {"type": "reasoning_text", "text": ""}},
            ]  # fmt: skip
        delta, self._thought = thought[len(self._thought) :], thought
        if delta:
            events.append({"type": "response.reasoning_text.delta", "item_id": self._reasoning["id"],
                           "output_index": self.items.index(self._reasoning), "content_index": 0, "delta": delta})  # fmt: skip
        return events

    def _close_reasoning(self, status: str) -> list[dict]:
        r, i = self._reasoning, self.items.index(self._reasoning)
        part = {"type": "reasoning_text", "text": self._thought}
        r["content"], r["status"] = [part], status
        self._reasoning, self._thought_closed = None, True
        return [
            {"type": "response.reasoning_text.done", "item_id": r["id"], "output_index": i, "content_index": 0,
             "text": self._thought},
            {"type": "response.content_part.done", "item_id": r["id"], "output_index": i, "content_index": 0,
             "part": part},
            {"type": "response.output_item.done", "output_index": i, "item": copy.deepcopy(r)},
        ]  # fmt: skip

    def update(
        self, text: str, calls: list[ToolCall] | None, final: bool, status: str = "completed",
        thought: str | None = None, thought_done: bool = False,
    ) -> list[dict]:  # fmt: skip
        """Take the completion's visible text and complete calls so far (``final``: all of it), and
        its reasoning so far (``thought``; ``thought_done``: all of it)."""
        events: list[dict] = []
        new_calls = (calls or [])[self._calls :]
        if thought and not self._thought_closed and not self._shown and not self._calls:  # before anything else
            events += self._reason(thought)
        if self._reasoning is not None and (thought_done or final or len(text) > self._shown or new_calls):
            events += self._close_reasoning("completed" if thought_done or not final else status)
        if self._message is None and self._calls:  # text after the calls: without the separator
            rest = text[self._shown :]
            self._shown += len(rest) - len(rest.lstrip())
        if len(text) > self._shown or (final and not self.items and not new_calls):
            if self._message is None:
                events += self._open_message()
            delta, self._shown = text[self._shown :], max(self._shown, len(text))
            if delta:
                events.append({"type": "response.output_text.delta", "item_id": self._message["id"],
                               "output_index": len(self.items) - 1, "content_index": 0, "delta": delta,
                               "logprobs": []})  # fmt: skip
        if new_calls and self._message is not None:
            events += self._close_message(text, "completed")
        for call in new_calls:
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": new_id("call"),
                    "name": call.name, "arguments": ""}  # fmt: skip
            self.items.append(item)
            i = len(self.items) - 1
            events.append({"type": "response.output_item.added", "output_index": i, "item": dict(item)})
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": i, "delta": call.arguments})  # fmt: skip
            item["arguments"], item["status"] = call.arguments, "completed"
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": i, "arguments": call.arguments})  # fmt: skip
            events.append({"type": "response.output_item.done", "output_index": i, "item": dict(item)})
            self._calls += 1
        if final and self._message is not None:
            events += self._close_message(text, status)
        return events


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a next turn's prompt continues from."""
    msgs: list[dict[str, Any]] = []
    thought = None  # a reasoning item's text: the next assistant message's reasoning_content
    for it in items:
        if it["type"] == "reasoning":
            thought = "".join(part["text"] for part in it["content"])
            continue
        if it["type"] == "message":
            msgs.append({"role": "assistant", "content": it["content"][0]["text"] if it["content"] else ""})
        else:
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        if thought is not None:
            msgs[-1]["reasoning_content"], thought = thought, None
    if thought is not None:  # it stopped while reasoning
        msgs.append({"role": "assistant", "content": "", "reasoning_content": thought})
    return msgs


def usage(input_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def now() -> int:
    return int(time.time())
