"""OpenAI's Responses API's output: the output items built from a completion (whole, or as it streams,
with the Responses event sequence: ``OutputBuilder``), and the usage object. The request's side is
``responses_input.py``, the store ``responses_store.py``, the endpoint ``responses_api.py``.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .tools import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
