"""Stop conditions over the tokens one step gives a request (several with speculation): tokens are
appended one by one and a stop inside the run cuts it there; the tokens after it are dropped."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..common import FinishReason
from ..common.outputs import TopLogprobs
from .request import Req


class StopChecker:
    """The engine owns stop detection (token ids, EOS, length, context, stop strings); the front only
    cuts the text where the finish reason's ``matched`` string starts."""

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
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return FinishReason("stop", matched=tok)
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason("length")
        if req.seq_len >= self.context_length:
            return FinishReason("length", "reached the context length")
        if p.stop and self.decode is not None:
            # Decode a tail long enough to contain the longest stop string.
            tail = self.decode(req.output_ids[-(max(map(len, p.stop)) + 8) :])
            for s in p.stop:
                if s in tail:
                    return FinishReason("stop", matched=s)
        return None
