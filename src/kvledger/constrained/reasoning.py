"""A grammar that starts after the model's reasoning (SGLang's reasoner grammar): with a reasoning
parser, a request that ``require_reasoning`` thinks freely until it generates the end marker's token
ids (``</think>``), and only the tokens after it must match its grammar (structured output, tool calls).

``ReasoningGate`` wraps a ``GrammarState`` with the same interface the scheduler uses (``masks``,
``drafts_before_end``, ``accept``, ``terminated``, ``too_slow``), so nothing else changes: while the reasoning runs a
step's rows are unmasked (``None``); in a step whose drafts close it, the rows after the marker are the
grammar's. The gate follows only kept tokens, like the matcher, so drafts are simulated, never applied.
"""

from __future__ import annotations

import numpy as np

from .matcher import GrammarState


def reasoning_end_ids(tokenizer, marker: str) -> list[int]:
    """The token ids the model writes ``marker`` as (one id where it is an added token, as in Qwen3 and
    DeepSeek-R1); ValueError if the tokenizer has no way to write it."""
    if tokenizer is None:
        raise ValueError("a reasoning parser needs the model's tokenizer, and this model has none")
    ids = list(tokenizer.encode(marker, add_special_tokens=False))
    if not ids:
        raise ValueError(f"the tokenizer cannot write the reasoning's end marker {marker!r}")
    return ids


class ReasoningGate:
    """One request's grammar behind its reasoning: inactive until ``end_ids`` appear in the output."""

    def __init__(self, inner: GrammarState, end_ids: list[int]):
        """``inner``: the request's grammar matcher, which the gate holds back until ``end_ids``."""
        self.inner = inner
        self.end_ids = list(end_ids)
        self.thinking = True
        self._tail: list[int] = []  # the last kept tokens, as many as the marker has (a partial match)

    def _end_at(self, tokens: list[int]) -> int | None:
        """The index in ``tokens`` (following the kept ones) of the token that completes the marker."""
        n = len(self.end_ids)
        tail = self._tail[:]
        for j, t in enumerate(tokens):
            tail = [*tail, t][-n:]
            if tail == self.end_ids:
                return j
        return None

    @property
    def terminated(self) -> bool:
        return not self.thinking and self.inner.terminated

    @property
    def too_slow(self) -> bool:
        return self.inner.too_slow

    def too_slow_error(self, kind: str):
        return self.inner.too_slow_error(kind)

    def drafts_before_end(self, drafts: list[int]) -> int:
        if not self.thinking:
            return self.inner.drafts_before_end(drafts)
        j = self._end_at(drafts)
        if j is None:
            return len(drafts)
        return j + 1 + self.inner.drafts_before_end(drafts[j + 1 :])

    def masks(self, drafts: list[int]) -> np.ndarray | None:
        """The step's rows (position ``j`` as if the first ``j`` drafts were kept): unmasked up to and
        including the position that draws the marker's last token, the grammar's after it; ``None``
        when no row is masked."""
        if not self.thinking:
            return self.inner.masks(drafts)
        j = self._end_at(drafts)
        if j is None:
            return None
        out = np.full((len(drafts) + 1, self.inner.width), -1, dtype=np.int32)
        out[j + 1 :] = self.inner.masks(drafts[j + 1 :])
        return out

    def accept(self, tokens: list[int]) -> bool:
        """Follow the kept tokens: the marker's ids end the reasoning, the grammar takes the rest."""
        if self.thinking:
            j = self._end_at(tokens)
            if j is None:
                self._tail = (self._tail + list(tokens))[-len(self.end_ids) :]
                return True
            self.thinking, self._tail = False, []
            tokens = tokens[j + 1 :]
        return self.inner.accept(tokens)
