"""The batch described for the executor: each chunk the policy picked becomes one ``ScheduledReq`` row.

A row carries the tokens to feed (the chunk's, then its drafts), a ``SamplingRow`` when the chunk
reaches the sequence's end (penalties' histories included), the token bitmask (a grammar's, and'ed
with min_new_tokens' held-back stop tokens), which prompt logprobs it computes, and which pooled rows
come back. It reads the request and writes nothing to it. ``StepStats`` are the batch's figures for
the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constrained import bitmask_width
from .output import SamplingRow, ScheduledReq, SchedulerOutput
from .policy import Chunk
from .request import Req
from .stop import StopChecker


@dataclass
class StepStats:
    num_tokens: int = 0
    num_decode: int = 0
    num_prefill_tokens: int = 0
    num_retracted: int = 0  # (counted by the policy as it retracts)

    def record(self, out: SchedulerOutput, chunks: list[Chunk]) -> None:
        self.num_tokens = out.num_tokens
        self.num_decode = sum(1 for c in chunks if c.num_tokens == 1)
        self.num_prefill_tokens = sum(c.num_tokens for c in chunks if c.num_tokens > 1)


def scheduled_row(c: Chunk, stop: StopChecker, vocab_size: int, overlap: bool) -> ScheduledReq:
    """The row of chunk ``c``; ``vocab_size`` is the width of token bitmasks, ``overlap`` whether the
    step may run while the scheduler changes the request (``overlap.py``)."""
    req, a = c.req, c.req.kv_len
    b = a + c.num_tokens
    sampling = None
    if b == req.seq_len:
        p = req.params
        pen = p.has_penalties
        # (overlap: a copy, for the list changes while the step runs; its placeholder is resolved
        # by the executor)
        hist = (list(req.output_ids) if overlap else req.output_ids) if pen else None
        sampling = SamplingRow(p, len(req.output_ids), req.input_ids if pen else None, hist)
    mask = None
    if sampling is not None:
        mask = req.grammar.masks(c.drafts) if req.grammar is not None else None
        mask = min_tokens_mask(req, len(c.drafts) + 1, mask, stop, vocab_size)
    sr = ScheduledReq(req.rid, req.slot, a, req.tokens(a, b) + c.drafts, len(c.drafts), sampling, mask)
    sr.lora = req.params.lora_path
    t = req.next_prompt_logprob
    if t is not None:
        # Token u's logprob comes from row u - 1: the rows of this chunk give tokens a+1 .. b.
        last = min(b, len(req.input_ids) - 1)
        if t < a + 1:
            raise RuntimeError(f"request {req.rid}: a wanted prompt logprob's row ({t}) was taken from a cache")
        if t <= last:
            sr.prompt_lp_targets, sr.prompt_lp_offset = req.input_ids[t : last + 1], t - 1 - a
            sr.prompt_lp_top = req.params.top_logprobs
    if req.params.scoring:
        sr.sampling = None  # scoring only: the prompt's logprobs, no token drawn
    if req.pooling is not None:
        _pooling_rows(req, sr, b)
    return sr


def _pooling_rows(req: Req, sr: ScheduledReq, b: int) -> None:
    """Which rows of a pooling request's chunk come back: mean pooling every position not yet
    summed (a chunk after a retraction may start before ``pooled_count``); the last position's
    hidden state, or its label logprobs, in the chunk that reaches the prompt's end."""
    p, a = req.pooling, sr.start
    if p.mean:
        sr.pool_from = max(req.pooled_count - a, 0)
    elif b == req.seq_len:
        if p.embed is not None:
            sr.pool_from = sr.num_tokens - 1
        else:
            sr.label_token_ids = p.label_token_ids


def min_tokens_mask(
    req: Req, rows: int, mask: np.ndarray | None, stop: StopChecker, vocab_size: int
) -> np.ndarray | None:
    """Below min_new_tokens the stop tokens are not drawn: their bits cleared in the rows of
    positions short of it (and'ed with a grammar's mask)."""
    short = req.params.min_new_tokens - len(req.output_ids)
    stop_ids = stop.stop_ids(req) if short > 0 else []
    if not stop_ids:  # (ignore_eos, no stop ids: nothing to hold back, so no all-ones mask per step)
        return mask
    if mask is None:
        mask = np.full((rows, bitmask_width(vocab_size)), -1, dtype=np.int32)
    bits = mask.view(np.uint32)
    for t in stop_ids:
        bits[:short, t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return mask
