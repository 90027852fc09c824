"""A request's tools: ``tools`` and ``tool_choice`` checked (``check_tools``: the tools, and the
function a request forces), and the conversation rendered for the chat template with them
(``render_messages``: the template's own tool support, or the parser's system prompt and call text
for a template without it). The formats themselves are ``tools.py``'s."""

from __future__ import annotations

from ..errors import ValidationError
from .tools import ToolParser, loads_object


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
            args = loads_object(args) if isinstance(args, str) else args
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
