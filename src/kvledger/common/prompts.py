"""Prompt parsing, written once: text or token ids, one prompt or a batch, to token-id lists.

Used by /generate, /v1/completions and the offline ``Engine``; token ids are range-checked later by
the one validation (``validation.validate_request``)."""

from __future__ import annotations

from typing import Any

from ..errors import ValidationError
from .validation import _is_int


def parse_prompts(
    text: Any, input_ids: Any, tokenizer, text_param: str = "text"
) -> tuple[list[list[int]], bool]:
    """Returns ``(token id lists, single)``; ``single`` is True for one prompt (not a list of them)."""
    if (text is None) == (input_ids is None):
        raise ValidationError(f"give exactly one of {text_param} and input_ids", param=text_param)
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts:
            raise ValidationError("the prompt is empty", param=text_param, code="empty_prompt")
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) or not t), None)
        if bad is not None:  # the item by its index, as token-id items are named (``input.2``)
            where = text_param if single else f"{text_param}.{bad}"
            raise ValidationError("the prompt is empty", param=where, code="empty_prompt")
        if tokenizer is None:
            raise ValidationError("this model has no tokenizer; send token ids instead", param=text_param)
        return [tokenizer.encode(t) for t in texts], single
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        raise ValidationError(
            "the prompt is empty; send at least one token", param="input_ids", code="empty_prompt"
        )
    single = not isinstance(input_ids[0], (list, tuple))
    return (
        [list(input_ids)] if single else [list(x) if isinstance(x, (list, tuple)) else x for x in input_ids]
    ), single


def split_openai_prompt(prompt: Any) -> tuple[Any, Any]:
    """An OpenAI ``prompt`` (a string, strings, token ids, or lists of them) as ``(text, input_ids)``."""
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
    ):
        return prompt, None
    if (
        isinstance(prompt, list)
        and prompt
        and (all(_is_int(p) for p in prompt) or all(isinstance(p, list) for p in prompt))
    ):
        return None, prompt
    if isinstance(prompt, list) and not prompt:
        raise ValidationError("the prompt is empty", param="prompt", code="empty_prompt")
    raise ValidationError(
        "prompt must be a string, a list of strings, token ids or lists of token ids", param="prompt"
    )
