"""Reasoning output (``--reasoning-parser``): a chat completion's text split into the model's reasoning
(``message.reasoning_content``, streamed as ``delta.reasoning_content``) and its answer (``content``),
as SGLang's reasoning parser splits it:

- ``thinking`` (the request's output begins inside the reasoning: always for ``deepseek-r1``, whose
  template opens ``<think>``; for ``qwen3`` unless ``chat_template_kwargs.enable_thinking`` is false):
  everything up to the end marker ``</think>`` is reasoning (a ``<think>`` the model writes first
  anyway is dropped); without it, ``<think>`` in the output starts the reasoning (text before it
  stays content). The reasoning ends at ``</think>`` (dropped) or, for ``qwen3``, at ``<tool_call>``
  (kept: it opens the answer's tool call). A completion that stops inside its reasoning has no
  content. Only the first reasoning block is split; later markers are content.
- The split is a function of the text so far (like the tool parser's), so the stream writer sends
  what is new in each part: while streaming, a tail that may be the beginning of a marker is held
  back until the next tokens tell, so a marker split across deltas (``</thi`` + ``nk>``) never
  leaks into either part. (SGLang holds back only a delta that is itself a marker's prefix.)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common.reasoning import ReasoningFormat


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: no reasoning in this output
    content: str
    closed: bool  # the reasoning is complete (its end came, or the completion did)


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper beginning of one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ReasoningParser:
    """One chat request's split (``thinking``: its output begins inside the reasoning; ``stream``:
    SGLang's ``stream_reasoning``, false sends the reasoning in one delta once it is complete)."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool, stream: bool = True):
        self.fmt = fmt
        self.thinking = thinking
        self.stream = stream
        self._ends = (fmt.end,) + ((fmt.tool_start,) if fmt.tool_start else ())

    def split(self, text: str, final: bool) -> Split:
        """``text`` (the completion so far; all of it when ``final``) as reasoning and content."""
        start = self.fmt.start
        head = ""
        if not self.thinking:
            at = text.find(start)
            if at < 0:
                hold = 0 if final else _partial(text, (start,))
                return Split(None, text[: len(text) - hold], False)
            head, text = text[:at], text[at + len(start) :]
        while text.startswith(start):  # the model opened the reasoning its template had opened
            text = text[len(start) :]
        if not final and text and start.startswith(text):
            return Split("", head, False)  # perhaps the beginning of a <think> still
        found = [(i, m) for m in self._ends if (i := text.find(m)) >= 0]
        if found:
            i, m = min(found)
            after = text[i + len(m) :] if m == self.fmt.end else text[i:]  # a tool call stays in the answer
            return Split(text[:i], head + after, True)
        if final:
            return Split(text, head, True)
        return Split(text[: len(text) - _partial(text, self._ends)], head, False)
