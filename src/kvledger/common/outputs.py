"""What the engine says about a request: its finish reason and per-step outputs, and the one builder
of the ``meta_info`` object that /generate and the offline ``Engine`` return."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..errors import KVLedgerError, error_for_status

TopLogprobs = list[tuple[int, float]]


class FinishReason(msgspec.Struct, omit_defaults=True):
    """Why a request ended. ``status`` >= 400 means it failed before (or while) producing output."""

    type: str  # "stop" | "length" | "abort"
    message: str | None = None
    matched: int | str | None = None  # the stop token id, stop string or stop_regex pattern that ended it
    matched_text: str | None = None  # a stop_regex's match: where the final text is cut
    status: int = 200  # HTTP status a front should answer with when nothing was streamed yet
    code: str | None = None
    param: str | None = None

    def to_dict(self) -> dict:
        """The ``meta_info.finish_reason`` object (SGLang's shape)."""
        d: dict = {"type": self.type}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message:
            d["message"] = self.message
        return d

    def to_error(self) -> KVLedgerError | None:
        """The error a front raises for this finish, or None when it is not an error."""
        if self.status < 400:
            return None
        return error_for_status(self.status, self.message or "request failed", self.code, self.param)

    @classmethod
    def from_error(cls, e: KVLedgerError) -> FinishReason:
        return cls("abort", e.message, status=e.status, code=e.code, param=e.param)


class RequestOutput(msgspec.Struct):
    """New tokens of one request from one step (several with speculation); the last one for a
    request has ``finished`` set and its finish reason."""

    rid: str
    new_ids: list[int]
    new_logprobs: list[float | None]
    new_top_logprobs: list[TopLogprobs | None]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    spec_verify_ct: int = 0  # the request's verify steps so far (speculative decoding)
    # Prompt logprobs computed this step, in prompt order (token 0's None is not sent).
    input_logprobs: list[float] = []
    input_top_logprobs: list[TopLogprobs | None] = []
    # A pooling request's answer, on its final output (common/pooling.py).
    embedding: list[float] | None = None
    label_logprobs: list[float] | None = None

    @classmethod
    def final(
        cls,
        rid: str,
        reason: FinishReason,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> RequestOutput:
        return cls(rid, [], [], [], True, reason, prompt_tokens, completion_tokens, cached_tokens)


@dataclass
class PromptLogprobs:
    """A reader's copy of one request's prompt logprobs (scoring), gathered from its outputs."""

    ids: list[int]  # the prompt
    start: int  # logprob_start_len
    top: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.logprobs.extend(out.input_logprobs)
        self.top_logprobs.extend(out.input_top_logprobs)

    def padded(self) -> tuple[list[float | None], list[TopLogprobs | None]]:
        """From token ``start`` on; token 0 has none (nothing precedes it)."""
        head: list = [None] if self.start == 0 else []
        return head + self.logprobs, head + self.top_logprobs


def meta_info(
    rid: str,
    prompt_tokens: int,
    output_ids: list[int],
    cached_tokens: int,
    finish: FinishReason | None,
    logprobs: list[float | None] | None = None,
    top_logprobs: list[TopLogprobs | None] | None = None,
    spec_verify_ct: int = 0,
    prompt: PromptLogprobs | None = None,
    token_text: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """SGLang's ``meta_info``; logprobs as ``[logprob, token_id, text]`` triples when asked for (text
    with ``token_text``, else None), the prompt's with ``prompt``; with speculation,
    ``spec_verify_ct`` and the mean tokens a verify step gave."""

    def text(t: int) -> str | None:
        return token_text(t) if token_text is not None else None

    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": cached_tokens,
        "finish_reason": finish.to_dict() if finish else None,
    }
    if logprobs is not None:
        meta["output_token_logprobs"] = [[lp, t, text(t)] for lp, t in zip(logprobs, output_ids)]
    if top_logprobs is not None:
        meta["output_top_logprobs"] = [[[lp, t, text(t)] for t, lp in (top or [])] for top in top_logprobs]
    if prompt is not None:
        lps, tops = prompt.padded()
        ids = prompt.ids[prompt.start : prompt.start + len(lps)]
        meta["input_token_logprobs"] = [[lp, t, text(t)] for lp, t in zip(lps, ids)]
        if prompt.top:
            meta["input_top_logprobs"] = [
                None if top is None else [[lp, t, text(t)] for t, lp in top] for top in tops
            ]
    if spec_verify_ct:
        meta["spec_verify_ct"] = spec_verify_ct
        meta["spec_accept_length"] = round(len(output_ids) / spec_verify_ct, 3)
    return meta
