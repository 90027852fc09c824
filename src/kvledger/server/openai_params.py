"""An OpenAI body read into what the engine takes: its sampling params (``sampling_dict``, checked
afterwards by the one validation), a ``response_format`` as a grammar, a chat message's text, and
the chat template's arguments (``template_options``)."""

from __future__ import annotations

import json
from typing import Any

from ..common import SamplingParams
from ..constrained.grammar import ANY_JSON
from ..errors import ValidationError
from .protocol import _OpenAICommon

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default, which SGLang and vLLM keep
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # "max": SGLang's
# apply_chat_template's own arguments: chat_template_kwargs may not reach them (a client's template).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


# The OpenAI bodies' fields that carry a sampling parameter under its own name: taken by name, so a
# sampling field declared on the body (protocol.py) with the type's name needs nothing here. The
# others (cache_salt: the salt; no_stop_trim: two spellings) are renamed or derived below.
_BY_NAME = tuple(
    f for f in SamplingParams.__struct_fields__
    if f in _OpenAICommon.model_fields and f not in ("cache_salt", "no_stop_trim")
)  # fmt: skip


def sampling_dict(body: _OpenAICommon, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> dict:
    """OpenAI fields -> SGLang sampling params (range checks happen in the one validation). Without
    ``max_tokens`` there is no ``max_new_tokens``: the endpoint's default applies (``validate_request``)."""
    rf = response_format_grammar(body.response_format)
    if rf and body.json_schema is not None:
        raise ValidationError("give json_schema or response_format, not both", param="json_schema")
    trims = [v for v in (body.no_stop_trim, body.include_stop_str_in_output) if v is not None]
    d: dict[str, Any] = {name: getattr(body, name) for name in _BY_NAME}
    d.update(rf)
    d.update(
        max_new_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        min_new_tokens=body.min_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        no_stop_trim=any(trims) if trims else None,
        cache_salt=body.salt(),
    )
    return {k: v for k, v in d.items() if v is not None}


def response_format_grammar(rf: dict | None) -> dict:
    """OpenAI ``response_format`` -> the sampling param that constrains the output."""
    if rf is None:
        return {}
    kind = rf.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": ANY_JSON}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ValidationError(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return {"json_schema": json.dumps(schema)}
    raise ValidationError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param="response_format.type",
    )


def text_parts(content: list[dict]) -> list[str]:
    """The text of a message's content parts (``[{"type": "text", "text": ...}]``): this server reads
    text only, so another kind of part is refused rather than dropped."""
    out = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValidationError(
                f"message content parts must be {{\"type\": \"text\", \"text\": string}}; got {str(part)[:80]}",
                param="messages",
            )
        out.append(part["text"])
    return out


def template_options(body) -> tuple[bool, dict[str, Any]]:
    """``add_generation_prompt`` and the rest of the template's arguments from ``body``:
    ``continue_final_message`` (vLLM: the last message is the assistant's, continued as is, with
    no generation prompt), ``documents``, ``reasoning_effort`` and ``chat_template_kwargs``."""
    kwargs: dict[str, Any] = dict(getattr(body, "chat_template_kwargs", None) or {})
    bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise ValidationError(
            f"chat_template_kwargs may not set {', '.join(bad)}", param=f"chat_template_kwargs.{bad[0]}"
        )
    agp = body.add_generation_prompt
    if body.continue_final_message:
        if agp:
            raise ValidationError(
                "continue_final_message continues the last message, so it cannot be combined with "
                "add_generation_prompt: true",
                param="continue_final_message",
            )
        if body.messages[-1].role != "assistant":
            raise ValidationError(
                "continue_final_message needs the last message to be the assistant's",
                param="continue_final_message",
            )
        kwargs["continue_final_message"] = True
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise ValidationError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort"
            )
        # As SGLang: templates read one of these (Qwen3: enable_thinking; DeepSeek: thinking).
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
        kwargs.setdefault("thinking", effort != "none")
    if getattr(body, "documents", None) is not None:
        kwargs["documents"] = body.documents
    return (not body.continue_final_message) if agp is None else agp, kwargs
