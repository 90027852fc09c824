"""Overlap scheduling (SGLang's overlap scheduler): the scheduler prepares step N+1 while step N
runs, from *placeholders* for the tokens step N is still sampling.

At launch a row that samples takes a future id; its request gets the placeholder ``-1 - future`` as
its newest output token and its ``kv_len`` advances past the fed tokens, as if the step were done.
Step N+1 then feeds the placeholder like any token: the executor side replaces it with step N's
sampled token before the forward (``resolve``; the steps run one after another on one thread, so
step N's token is there). When step N's result arrives (``Scheduler.update``) the placeholder is
replaced by the token, through the same stop checks as a synchronous step.

A row is overlapped only when nothing the next schedule needs depends on its result: no drafts
(their acceptance sets the KV length), no prompt logprobs or pooling (the next chunk's rows depend
on them), no grammar (the next mask needs the matcher advanced) and no proposer (drafts are proposed
from the output). A step holding any other row makes the next step wait for it (``needs_sync``):
that step is synchronous. A request that finishes while a later step holding it is in flight emits
its final output at once; its release (``Scheduler._finish`` -> hooks -> ``KVManager.release``)
waits until no launched step holds it, so no forward ever writes pages that were given back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .output import SchedulerOutput
from .request import Req


def placeholder(future: int) -> int:
    """The token id standing for the token of the row with ``future`` (negative: never a real id)."""
    return -1 - future


def is_placeholder(token: int) -> bool:
    return token < 0


@dataclass
class Flight:
    """A launched step whose result the scheduler has not applied: its requests in row order, and
    which rows were overlapped (advanced at launch)."""

    reqs: list[Req]
    overlapped: list[bool]
    starts: list[int]  # each row's first position: the KV its queries read starts at most W before it

    @property
    def blocks_next(self) -> bool:
        """The next schedule needs this step's result first (a row that was not overlapped)."""
        return not all(self.overlapped)


def strip_placeholders(req: Req) -> None:
    """A request that ends drops the tokens it never received, and its KV length falls back to what
    a synchronous step leaves (every token's KV but the last one's)."""
    ids = req.output_ids
    while ids and is_placeholder(ids[-1]):
        ids.pop()
    req.kv_len = min(req.kv_len, max(req.seq_len - 1, 0))


def resolve(sched: SchedulerOutput, tokens: dict[int, int]) -> SchedulerOutput:
    """Executor side, before the forward: the placeholders in ``sched`` (fed tokens, a penalty row's
    history) replaced by the tokens the previous step sampled (``tokens``: future id -> token). A
    placeholder whose row failed (fault isolation) becomes token 0: its request has ended, and the
    row's result is dropped."""
    rows = []
    for sr in sched.reqs:
        ids = sr.token_ids
        if any(t < 0 for t in ids):
            sr = dataclasses.replace(sr, token_ids=[t if t >= 0 else tokens.get(-1 - t, 0) for t in ids])
        s = sr.sampling
        if s is not None and s.output_ids is not None and any(t < 0 for t in s.output_ids):
            hist = [t if t >= 0 else tokens.get(-1 - t, 0) for t in s.output_ids]
            sr = dataclasses.replace(sr, sampling=dataclasses.replace(s, output_ids=hist))
        rows.append(sr)
    return dataclasses.replace(sched, reqs=rows)
