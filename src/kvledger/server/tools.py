"""Tool calling: the tool-call formats models are trained on (``--tool-call-parser``), each written
(a call, a system prompt describing the tools) and parsed from a completion (whole, or as it
streams) into OpenAI ``tool_calls``. A request's tools are checked and rendered into its
conversation in ``tool_requests``; the grammar that enforces ``tool_choice`` and
``parallel_tool_calls`` is built from each format's pieces in ``tool_grammar``.

Formats:
- ``hermes`` / ``qwen``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (one
  block per call), what Hermes, Qwen 2.5/3 and SmolLM2's training data use.
- ``llama3``: ``{"name": ..., "parameters": {...}}`` (calls separated by ``;``), optionally after
  ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

A chat template that uses ``tools`` renders them itself; for one that does not (SmolLM2-135M's), a
system message describing the tools in the parser's format is added, and earlier assistant tool calls
are written back in that format, so the model sees one consistent convention.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        if index is not None:
            d["index"] = index
        return d


def loads_object(text: str) -> dict | None:
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return None
    return v if isinstance(v, dict) else None


class ToolParser:
    """One tool-call format. ``start`` marks where calls begin in a completion. A call is written
    ``call_open(name) + arguments + call_close``; several are joined by ``separator`` inside
    ``list_open ... list_close`` (what the tool-call grammar builds on)."""

    name = ""
    start = ""
    args_key = "arguments"
    separator = "\n"
    list_open = ""
    list_close = ""
    call_close = "}"

    def call_open(self, name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_key}": '

    def format_call(self, name: str, arguments: dict) -> str:
        return self.format_calls([(name, arguments)])

    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        body = self.separator.join(
            self.call_open(n) + json.dumps(a, ensure_ascii=False) + self.call_close for n, a in calls
        )
        return self.list_open + body + self.list_close

    def scan(self, text: str) -> tuple[list[ToolCall], int]:
        """The complete calls at the beginning of ``text`` (which starts at ``start``) and where the
        last of them ends; ``([], 0)`` while the first is incomplete or if it is not a call."""
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = self.format_call("<function-name>", {"<arg>": "<value>"})
        return (
            "You are a function-calling assistant. You may call one or more of these functions:\n"
            f"{specs}\n"
            f"To call a function, answer only with:\n{example}\n"
            "Otherwise answer normally."
        )

    def _call(self, obj: dict | None) -> ToolCall | None:
        if obj is None or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(self.args_key, obj.get("arguments", {}))
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def split(self, text: str, final: bool, cut: bool = False) -> tuple[str, list[ToolCall] | None]:
        """``(content, calls)``: the text before the calls and the complete calls so far (None while
        there is none). While streaming (not ``final``), a partial ``start`` and what follows the last
        complete call are held back; at the end, text that is not a complete call is content, so
        nothing is lost (a model that writes a malformed call is shown it as text) and a streamed call
        is never taken back. ``cut``: a limit (``max_tokens``, the context) ended the completion, so
        what follows the calls' start after the last complete call is the call it cut: dropped,
        neither a call nor content (so is a partial ``start`` at the very end)."""
        at = text.find(self.start)
        if at < 0:
            if not final or cut:  # hold back (or, cut, drop) what may be the beginning of ``start``
                for k in range(min(len(self.start) - 1, len(text)), 0, -1):
                    if self.start.startswith(text[-k:]):
                        return text[:-k], None
            return text, None
        calls, end = self.scan(text[at:])
        whole = final and not cut
        if not calls:
            return (text, None) if whole else (text[:at].rstrip(), None)
        rest = text[at + end :].strip() if whole else ""
        return "\n".join(x for x in (text[:at].rstrip(), rest) if x), calls


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    call_close = "}\n</tool_call>"

    def call_open(self, name: str) -> str:
        return f"{self.start}\n" + super().call_open(name)

    def scan(self, text: str) -> tuple[list[ToolCall], int]:
        calls, done = [], 0
        while True:
            i = _skip(text, done, " \n\t")
            j = text.find(self.end, i)
            if not text.startswith(self.start, i) or j < 0:
                return calls, done
            call = self._call(loads_object(text[i + len(self.start) : j].strip()))
            if call is None:
                return calls, done
            calls.append(call)
            done = j + len(self.end)


PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(ToolParser):
    name = "llama3"
    start = '{"name"'
    args_key = "parameters"
    separator = "; "

    def split(self, text: str, final: bool, cut: bool = False) -> tuple[str, list[ToolCall] | None]:
        # Llama 3.1 may open its calls with <|python_tag|>: a marker, not content.
        content, calls = super().split(text.replace(PYTHON_TAG, ""), final, cut)
        return (content, calls) if calls else super().split(text, final, cut)

    def scan(self, text: str) -> tuple[list[ToolCall], int]:
        dec = json.JSONDecoder()
        calls, done = [], 0
        while True:
            i = _skip(text, done, " \n\t;")
            try:
                obj, j = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                return calls, done
            call = self._call(obj if isinstance(obj, dict) else None)
            if call is None:
                return calls, done
            calls.append(call)
            done = j


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    separator = ", "
    list_open = "[TOOL_CALLS] ["
    list_close = "]"

    def scan(self, text: str) -> tuple[list[ToolCall], int]:
        dec = json.JSONDecoder()
        i = _skip(text, len(self.start), " \n\t")
        if text.startswith("{", i):  # one call without the list
            try:
                obj, j = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                return [], 0
            call = self._call(obj if isinstance(obj, dict) else None)
            return ([call], j) if call else ([], 0)
        if not text.startswith("[", i):
            return [], 0
        calls, done, i = [], 0, i + 1
        while True:
            i = _skip(text, i, " \n\t")
            try:
                obj, i = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                return calls, done
            call = self._call(obj if isinstance(obj, dict) else None)
            if call is None:
                return calls, done
            calls.append(call)
            done = i = _skip(text, i, " \n\t")
            if text.startswith("]", i):
                return calls, i + 1
            if not text.startswith(",", i):
                return calls, done
            i += 1


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen25": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}


def make_parser(name: str) -> ToolParser:
    return PARSERS[name]()
