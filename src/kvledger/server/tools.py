"""Tool calling: the tool-call formats models are trained on (``--tool-call-parser``), how a
conversation with tools is rendered, the grammar that enforces ``tool_choice`` ``required`` or a
named function, and parsing a completion (whole, or as it streams) into OpenAI ``tool_calls``.

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

from ..errors import ValidationError


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


def _loads_object(text: str) -> dict | None:
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return None
    return v if isinstance(v, dict) else None


class ToolParser:
    """One tool-call format. ``start`` marks where calls begin in a completion."""

    name = ""
    start = ""
    args_key = "arguments"

    def format_call(self, name: str, arguments: dict) -> str:
        raise NotImplementedError

    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(self.format_call(n, a) for n, a in calls)

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in ``text`` (which starts at ``start``); None if it is not (yet) complete."""
        raise NotImplementedError

    def call_body_schema(self, name: str, parameters: dict) -> dict:
        return {
            "type": "object",
            "properties": {"name": {"const": name}, self.args_key: parameters or {"type": "object"}},
            "required": ["name", self.args_key],
        }

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

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall] | None]:
        """``(content, calls)``: the text before the calls (minus a partial ``start`` still being
        written, unless ``final``) and the calls once complete (None while none or incomplete)."""
        at = text.find(self.start)
        if at < 0:
            if not final:  # hold back what may be the beginning of ``start``
                for k in range(min(len(self.start) - 1, len(text)), 0, -1):
                    if self.start.startswith(text[-k:]):
                        return text[:-k], None
            return text, None
        calls = self.parse_calls(text[at:])
        if calls is None and final:
            return text, None  # an unfinished call is shown as text: nothing is lost
        return text[:at].rstrip(), calls


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def format_call(self, name: str, arguments: dict) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.start}\n{body}\n{self.end}"

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        calls, rest = [], text
        while rest.strip():
            rest = rest.strip()
            if not rest.startswith(self.start) or self.end not in rest:
                return None
            body, rest = rest[len(self.start) :].split(self.end, 1)
            call = self._call(_loads_object(body.strip()))
            if call is None:
                return None
            calls.append(call)
        return calls or None


PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(ToolParser):
    name = "llama3"
    start = '{"name"'
    args_key = "parameters"

    def format_call(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "; ".join(self.format_call(n, a) for n, a in calls)

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall] | None]:
        content, calls = super().split(text, final)
        # Llama 3.1 may open its calls with <|python_tag|>: a marker, not content.
        return (content.replace(PYTHON_TAG, "").rstrip() if calls else content), calls

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        dec = json.JSONDecoder()
        calls, i = [], 0
        text = text.replace(PYTHON_TAG, "")
        while i < len(text):
            while i < len(text) and text[i] in " \n\t;":
                i += 1
            if i >= len(text):
                break
            try:
                obj, i = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                return None
            call = self._call(obj if isinstance(obj, dict) else None)
            if call is None:
                return None
            calls.append(call)
        return calls or None


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def format_call(self, name: str, arguments: dict) -> str:
        return self.format_calls([(name, arguments)])

    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        body = [{"name": n, "arguments": a} for n, a in calls]
        return f"{self.start} {json.dumps(body, ensure_ascii=False)}"

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        try:
            items = json.loads(text[len(self.start) :])
        except json.JSONDecodeError:
            return None
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list):
            return None
        calls = [self._call(x if isinstance(x, dict) else None) for x in items]
        return None if not calls or None in calls else calls


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen25": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}


def make_parser(name: str) -> ToolParser:
    return PARSERS[name]()


# -- requests -----------------------------------------------------------------------------------------
def check_tools(tools, tool_choice) -> tuple[list[dict], str | None]:
    """Validate ``tools`` and ``tool_choice``; returns the tools and the forced function's name
    (``"*"`` for ``required``, None for ``auto``). ``none`` or no tools: ``([], None)``."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ValidationError("tool_choice needs tools", param="tool_choice")
        return [], None
    if not isinstance(tools, list) or not tools:
        raise ValidationError("tools must be a non-empty list", param="tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValidationError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools.{i}"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValidationError(
                f"tools[{i}].function.name must be a non-empty string", param=f"tools.{i}.function.name"
            )
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ValidationError(
                f"tools[{i}].function.parameters must be a JSON schema object",
                param=f"tools.{i}.function.parameters",
            )
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise ValidationError("tool names must be distinct", param="tools")
    if tool_choice in (None, "auto"):
        return tools, None
    if tool_choice == "none":
        return [], None
    if tool_choice == "required":
        return tools, "*"
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValidationError(
            "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in names:
        raise ValidationError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return tools, name


def forced_grammar(parser: ToolParser, tools: list[dict], forced: str) -> str:
    """EBNF that admits exactly one call of the forced function (or of any tool for ``*``), in the
    parser's format. Built with xgrammar's grammar algebra and handed to the engine as ``ebnf``."""
    import xgrammar as xgr

    def one(fn: dict) -> object:
        body = xgr.Grammar.from_json_schema(
            json.dumps(parser.call_body_schema(fn["name"], fn.get("parameters") or {"type": "object"})),
            any_whitespace=False,
        )
        before, after = _wrappers(parser)
        parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(before)}")] if before else []
        parts.append(body)
        if after:
            parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(after)}"))
        return xgr.Grammar.concat(*parts) if len(parts) > 1 else body

    fns = [t["function"] for t in tools if forced in ("*", t["function"]["name"])]
    grammars = [one(fn) for fn in fns]
    g = xgr.Grammar.union(*grammars) if len(grammars) > 1 else grammars[0]
    return str(g)


def _wrappers(parser: ToolParser) -> tuple[str, str]:
    if isinstance(parser, HermesParser):
        return parser.start + "\n", "\n" + parser.end
    if isinstance(parser, MistralParser):
        return parser.start + " [", "]"
    return "", ""


def render_messages(
    messages: list[dict], tools: list[dict], parser: ToolParser, template_has_tools: bool
) -> list[dict]:
    """Messages for the chat template. With a template that knows tools, assistant ``tool_calls`` get
    their arguments as objects (what such templates expect); without one, the tools become a system
    message and earlier calls are written as the parser's text."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        parsed = []
        for c in calls:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            args = fn.get("arguments", "{}")
            args = _loads_object(args) if isinstance(args, str) else args
            parsed.append((fn.get("name", ""), args if isinstance(args, dict) else {}))
        if parsed and template_has_tools:
            m["tool_calls"] = [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in parsed
            ]
        elif parsed:
            text = parser.format_calls(parsed)
            m["content"] = f"{m.get('content') or ''}\n{text}".strip()
        out.append(m)
    if tools and not template_has_tools:
        prompt = parser.system_prompt([t["function"] for t in tools])
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
