"""Stop conditions over the tokens one step gives a request (several with speculation): tokens are
appended one by one and a stop inside the run cuts it there; the tokens after it are dropped.

A ``stop_regex`` runs on the engine's thread after every token, so it is matched with RE2
(``common/patterns.py``: linear time, no backtracking) and over a bounded window: the text of the
last ``REGEX_TAIL_TOKENS`` tokens (the new token and a fixed look-back), never the whole output. A
step's stop checks cost at most (patterns: --max-stop-strings) x (one linear scan of the window).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..common import FinishReason
from ..common.outputs import TopLogprobs
from ..common.patterns import compile_pattern
from .request import Req

# A stop_regex match is looked for in the text of the last this many tokens: a match must fit in
# them (a longer one is not seen), and each check decodes and scans no more than them.
REGEX_TAIL_TOKENS = 64


class StopChecker:
    """The engine owns stop detection (token ids, EOS, length, context, stop strings); the front only
    cuts the text where the finish reason's matched string (or a stop_regex's ``matched_text``) starts."""

    def __init__(
        self, eos_token_ids: Iterable[int], context_length: int, decode: Callable[[list[int]], str] | None
    ):
        self.eos_token_ids = set(eos_token_ids)
        self.context_length = context_length
        self.decode = decode

    def append(
        self,
        req: Req,
        tokens: list[int],
        logprobs: list[float | None],
        top_logprobs: list[TopLogprobs | None],
    ) -> int:
        """Append ``tokens`` to ``req`` up to and including the first that ends it; returns how many."""
        for j, tok in enumerate(tokens):
            req.output_ids.append(tok)
            req.output_logprobs.append(logprobs[j] if j < len(logprobs) else None)
            req.output_top_logprobs.append(top_logprobs[j] if j < len(top_logprobs) else None)
            reason = self.check(req, tok)
            if reason is not None:
                req.mark_finish(reason)
                return j + 1
        return len(tokens)

    def check(self, req: Req, tok: int) -> FinishReason | None:
        p = req.params
        early = len(req.output_ids) <= p.min_new_tokens  # stops before min_new_tokens do not count
        if not early and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids)):
            return FinishReason("stop", matched=tok)
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason("length")
        if req.seq_len >= self.context_length:
            return FinishReason("length", "reached the context length")
        if early or self.decode is None:
            return None
        if p.stop:
            # Decode a tail long enough to contain the longest stop string.
            tail = self.decode(req.output_ids[-(max(map(len, p.stop)) + 8) :])
            for s in p.stop:
                if s in tail:
                    return FinishReason("stop", matched=s)
        if p.stop_regex:
            if req.stop_patterns is None:  # compiled at validation: this takes them from the cache
                req.stop_patterns = [compile_pattern(r, "stop_regex") for r in p.stop_regex]
            tail = self.decode(req.output_ids[-REGEX_TAIL_TOKENS:])
            for r, rx in zip(p.stop_regex, req.stop_patterns):
                m = rx.search(tail)
                if m and m.group(0):  # SGLang reports the pattern; the front cuts at the match
                    return FinishReason("stop", matched=r, matched_text=m.group(0))
        return None

    def stop_ids(self, req: Req) -> list[int]:
        """The tokens that would end ``req`` (masked while it is short of min_new_tokens)."""
        p = req.params
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
