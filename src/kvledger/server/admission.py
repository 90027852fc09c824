"""How much one body and one caller may ask of the engine (issue 50: one 100 KB body of 20,000
prompts x ``n=4`` became 80,000 engine requests and ~1.4 GB in the front).

Checked in this order, each before anything is allocated:

1. the body's size, before it is parsed (``middleware.BodyLimitMiddleware``, ``--max-body-bytes``);
2. the prompts one body carries and the engine requests they fan out to (prompts x ``n``), before a
   prompt is tokenized (``check_fanout``: 400 naming the flag);
3. the prompt tokens of the whole body, once tokenized (``check_prompt_tokens``: 400);
4. the caller's engine requests in flight, this body's included (``InFlight``: 429 with
   ``Retry-After``). A caller is the principal ``auth.py`` found (the user key, the admin key, or
   anonymous on a server without keys).

A body whose client goes away aborts every one of its engine requests
(``GenerationService.collect_all``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import OverloadedError, ValidationError


@dataclass(frozen=True)
class AdmissionLimits:
    max_prompts: int = 2048
    """Prompts (or inputs, items, documents) in one body: OpenAI's embeddings limit."""
    max_choices: int = 1024
    """Engine requests one body fans out to (prompts x ``n``)."""
    max_prompt_tokens: int = 1 << 20
    """Prompt tokens of one body, all its prompts together."""
    max_requests_per_key: int = 1024
    """Engine requests one caller may have in flight (queued or running) at once."""


def check_fanout(limits: AdmissionLimits, prompts: int, n: int = 1, param: str = "prompt") -> None:
    """400 when a body's prompts, or its prompts x ``n``, pass the limits (before any is tokenized)."""
    if prompts > limits.max_prompts:
        raise ValidationError(
            f"at most {limits.max_prompts} prompts per request (--max-prompts-per-request), got {prompts}",
            param=param, code="too_many_prompts",
        )  # fmt: skip
    if prompts * n > limits.max_choices:
        raise ValidationError(
            f"{prompts} prompts x n={n} is {prompts * n} completions; at most {limits.max_choices} per "
            "request (--max-choices-per-request)",
            param="n" if n > 1 else param, code="too_many_choices",
        )  # fmt: skip


def check_prompt_tokens(limits: AdmissionLimits, prompts: list[list[int]], param: str = "prompt") -> None:
    total = sum(map(len, prompts))
    if total > limits.max_prompt_tokens:
        raise ValidationError(
            f"the request's prompts hold {total} tokens; at most {limits.max_prompt_tokens} per request "
            "(--max-prompt-tokens-per-request)",
            param=param, code="too_many_prompt_tokens",
        )  # fmt: skip


def prompt_count(prompt: object) -> int:
    """How many prompts an OpenAI ``prompt`` / ``input`` or SGLang ``text`` / ``input_ids`` holds
    (a string or one token-id list is one), counted without tokenizing anything."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


class InFlight:
    """The engine requests each caller has in flight. ``hold`` takes ``count`` of them for a body
    (429 with ``Retry-After`` past the limit, before anything is submitted) and gives them back when
    the body's requests have ended, however they end."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held: Counter[str] = Counter()

    def check_room(self, who: str, count: int) -> None:
        """429 unless ``who`` may start ``count`` more (a body checks all of its requests at once,
        so none of them starts when they would not all fit)."""
        if self.held[who] + count > self.limit:
            raise OverloadedError(
                f"{self.held[who]} requests of this caller are in flight and this one needs {count} more; "
                f"at most {self.limit} (--max-requests-per-key): retry when some have finished",
                code="too_many_requests_in_flight",
            )

    @contextlib.contextmanager
    def hold(self, who: str, count: int = 1) -> Iterator[None]:
        self.check_room(who, count)
        self.held[who] += count
        try:
            yield
        finally:
            self.held[who] -= count
            if not self.held[who]:
                del self.held[who]
