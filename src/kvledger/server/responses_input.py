"""A Responses request read as a chat one: its ``input`` (a string, or message, function_call,
function_call_output and reasoning items), its flat tools, ``tool_choice`` and ``text.format`` in
the chat shapes; and a stored response's output items as the chat messages a next turn continues
from (``output_messages``: with its input, the conversation ``previous_response_id`` reads)."""

from __future__ import annotations

from typing import Any

from ..errors import ValidationError

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, param: str, images: bool = False) -> str | list[dict]:
    """A message's or tool output's content: a string or text parts (``input_text``/``output_text``);
    with ``images`` (a message's) also ``input_image`` parts, which make it chat content parts
    (``image_url``, read by ``image_parts.py``); another kind of part (a file) is refused rather
    than dropped."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(f"{param} must be a string or a list of text parts", param=param)
    if images and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return [_chat_part(p, f"{param}.{j}") for j, p in enumerate(content)]
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValidationError(
                f"{param}[{j}] must be {{\"type\": \"input_text\", \"text\": string}}; this server reads text only",
                param=f"{param}.{j}",
            )
        out.append(part["text"])
    return "".join(out)


def _chat_part(part: Any, param: str) -> dict:
    """A Responses content part as a chat one: ``input_image`` (its ``image_url`` a URL string) as
    ``image_url``, text as text."""
    if isinstance(part, dict) and part.get("type") == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise ValidationError("input_image needs an image_url (file_id is not supported)", param=param)
        # (``_part``: the Responses name of the part, which a 400 about it gives: image_parts.py)
        return {"type": "image_url", "image_url": {"url": url}, "_part": param}
    if isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    raise ValidationError(f"{param} must be a text or input_image part", param=param)


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
            msgs.append({"role": role, "content": _text(item.get("content"), f"{p}.content", images=role == "user")})
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
