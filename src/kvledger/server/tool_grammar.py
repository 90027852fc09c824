"""The grammar of the tool calls a chat request may make, in the parser's format (OpenAI's rules):

- ``tool_choice: "required"``: one or more calls of any tool; exactly one with
  ``parallel_tool_calls: false``;
- a named function: exactly one call of it;
- ``auto`` with ``parallel_tool_calls: false``: any text, or text then one call (the grammar ends
  after it); ``auto`` with parallel calls allowed is not constrained.

Each call's arguments follow the tool's ``parameters`` schema, compiled on its own (so its ``$defs``
and ``$ref`` resolve as written) and checked like any schema (``json_schema_grammar``): a schema
with a keyword that is not enforced, or one that does not compile, is a 400 naming the tool, raised
here in the front before the request is sent. The pieces are put together with xgrammar's
structural tags and handed to the engine as EBNF.
"""

from __future__ import annotations

from ..constrained.json_schema import json_schema_grammar
from ..errors import ValidationError
from .tools import ToolParser


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _sequence(*parts: dict) -> dict:
    parts = tuple(p for p in parts if p.get("value") != "")
    return parts[0] if len(parts) == 1 else {"type": "sequence", "elements": list(parts)}


def tool_call_grammar(
    parser: ToolParser, tools: list[dict], forced: str | None, parallel: bool
) -> str | None:
    """EBNF for the calls ``tools`` allow (``forced``: ``"*"`` for required, a name, or None for
    auto; ``parallel``: several calls allowed), or None when the output is not constrained."""
    import xgrammar as xgr  # lazy: see GrammarBackend

    if not tools or (forced is None and parallel):
        return None
    arguments = {
        t["function"]["name"]: _arguments(i, t["function"])
        for i, t in enumerate(tools)
        if forced in (None, "*", t["function"]["name"])
    }
    if forced is None:  # auto, at most one call
        fmt = {
            "type": "triggered_tags",
            "triggers": [parser.start],
            "tags": [
                {
                    "type": "tag",
                    "begin": parser.list_open + parser.call_open(name),
                    "content": {"type": "grammar", "grammar": args},
                    "end": parser.call_close + parser.list_close,
                }
                for name, args in arguments.items()
            ],
            "stop_after_first": True,
        }
    else:
        calls = [
            _sequence(_const(parser.call_open(name)), {"type": "grammar", "grammar": args},
                      _const(parser.call_close))
            for name, args in arguments.items()
        ]  # fmt: skip
        one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        if forced == "*" and parallel:
            one = _sequence(one, {"type": "star", "content": _sequence(_const(parser.separator), one)})
        fmt = _sequence(_const(parser.list_open), one, _const(parser.list_close))
    try:
        return str(xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": fmt}))
    except (RuntimeError, ValueError, TypeError) as e:  # not expected: the pieces compiled
        raise ValidationError(
            f"the tool-call grammar does not compile: {e}", param="tools", code="invalid_grammar"
        ) from None


def _arguments(i: int, fn: dict) -> str:
    params = fn.get("parameters") or {"type": "object"}
    grammar = json_schema_grammar(
        params, param=f"tools.{i}.function.parameters", what=f"tools[{i}] ({fn['name']}): parameters"
    )
    return str(grammar)
