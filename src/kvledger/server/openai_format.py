"""What an OpenAI answer says, from the front's state of each choice (``GenState``): finish
reasons, ``matched_stop``, usage, logprobs in the chat and the completions shapes, a whole answer's
chat message, and a streamed answer's chunks (``Chunks``), each an SSE event (``sse``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .generation import GenState
from .reasoning import ReasoningParser
from .tools import ToolCall, ToolParser


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def finish_reason(st: GenState) -> str | None:
    return None if st.finish is None else st.finish.type


def split_calls(tools: ToolParser, text: str, st: GenState) -> tuple[str, list[ToolCall] | None]:
    """A completion's content and complete tool calls so far. One cut by ``max_tokens`` or the
    context keeps only its complete calls: the call the limit cut is dropped, never shown as content
    (and the finish reason stays ``length``: ``tool_finish_reason``)."""
    return tools.split(text, st.finished, cut=st.finish is not None and st.finish.type == "length")


def tool_finish_reason(st: GenState, calls) -> str | None:
    """``tool_calls`` when the model ended its turn with calls; any other end (a limit) says itself."""
    fr = finish_reason(st)
    return "tool_calls" if calls and fr == "stop" else fr


def matched_stop(st: GenState) -> int | str | None:
    """SGLang's ``matched_stop``: the stop token id, stop string or stop_regex pattern that ended the choice."""
    return st.finish.matched if st.finish is not None and st.finish.type == "stop" else None


def usage(states: list[GenState | None], jobs, n: int) -> dict:
    """Usage of a request's choices (``n`` per prompt, in order; None: a choice that failed). A
    prompt and its cached tokens count once, from its first choice, whatever ``n`` (SGLang's rule)."""
    firsts = range(0, len(jobs), n)
    p = sum(len(jobs[i][0]) for i in firsts)
    c = sum(len(s.output_ids) for s in states if s is not None)
    cached = sum(states[i].cached_tokens for i in firsts if states[i] is not None)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def logprobs(
    st: GenState, chat: bool, text: Callable[[int], str], start: int = 0, echo: bool = False
) -> dict | None:
    """A choice's logprobs from its token ``start`` on (with ``echo``, the prompt's first), in the
    chat shape (``content``) or the completions one (``tokens``, ``text_offset``); None when the
    request asked for none. ``text`` is a token's text."""
    if not (st.params.logprobs or st.params.top_logprobs):
        return None
    ids, lps, tops = st.output_ids[start:], st.logprobs[start:], st.top_logprobs[start:]
    if echo and st.prompt is not None:  # the prompt's tokens first (the first has no logprob)
        plps, ptops = st.prompt.padded()
        ids, lps, tops = st.prompt.ids + ids, plps + lps, ptops + tops
    if chat:
        return {
            "content": [
                {
                    "token": text(t),
                    "logprob": lp,
                    "bytes": list(text(t).encode()),
                    "top_logprobs": [
                        {"token": text(a), "logprob": b, "bytes": list(text(a).encode())}
                        for a, b in (top or [])
                    ],
                }
                for t, lp, top in zip(ids, lps, tops)
            ]
        }
    texts = [text(t) for t in ids]
    offsets, at = [], 0
    for piece in texts:
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": texts,
        "token_logprobs": lps,
        "top_logprobs": [None if top is None else {text(a): b for a, b in top} for top in tops],
        "text_offset": offsets,
    }


def chat_message(
    st: GenState, tools: ToolParser | None, reasoning: ReasoningParser | None
) -> tuple[dict, str | None]:
    """A whole chat answer's message for one choice, and its finish reason (``tool_calls`` when the
    turn ended with calls)."""
    # reasoning_content: null without reasoning, as SGLang and vLLM answer (their
    # clients read it; the openai SDK raises for a field the answer lacks).
    text, thought = st.visible, None
    if reasoning is not None:
        part = reasoning.split(text, final=True)
        text, thought = part.content, part.reasoning or None
    content, calls = split_calls(tools, text, st) if tools else (text, None)
    message = {"role": "assistant", "content": content, "reasoning_content": thought}
    if calls:
        message = {
            "role": "assistant",
            "content": content or None,
            "reasoning_content": thought,
            "tool_calls": [call.to_openai() for call in calls],
        }
    return message, tool_finish_reason(st, calls)


@dataclass(frozen=True)
class Chunks:
    """The chunks of one streamed answer: what every chunk repeats (``id``, ``object``, ``created``,
    ``model``) and, with ``continuous_usage``, each choice's usage so far (``prompt_lens``: each
    choice's prompt length)."""

    id: str
    chat: bool
    created: int
    model: str
    prompt_lens: list[int]
    continuous_usage: bool

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(
        self, i: int, delta_text: str | None, st: GenState | None, fr=None, lp=None, role=False, calls=None,
        thought: str | None = None,
    ) -> dict:  # fmt: skip
        """Choice ``i``'s chunk: its new text (a chat delta, or a completion's ``text``), finish
        reason, logprobs, and in a chat the role, tool calls and reasoning."""
        c: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": fr}
        c["matched_stop"] = matched_stop(st) if fr is not None and st is not None else None
        if self.chat:
            delta: dict[str, Any] = {"reasoning_content": thought}  # as in the message (SGLang's deltas)
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            if calls is not None:
                delta["tool_calls"] = calls
            c["delta"] = delta
        else:
            c["text"] = delta_text or ""
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": [c]}
        if self.continuous_usage:  # vLLM's and SGLang's: this choice's usage so far, in every chunk
            p, k = self.prompt_lens[i], len(st.output_ids) if st is not None else 0
            out["usage"] = {"prompt_tokens": p, "completion_tokens": k, "total_tokens": p + k}
        return out

    def usage_chunk(self, totals: dict) -> dict:
        """The last chunk of ``include_usage``: no choices, the whole request's usage."""
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [], "usage": totals}  # fmt: skip
