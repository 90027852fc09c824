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

``InFlight`` keeps the books of launched steps: which requests each holds, which of its rows were
advanced, and the future ids of their placeholders.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from .output import ScheduledReq, SchedulerOutput
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


class InFlight:
    """Steps launched and not yet updated, how many of them hold each request, and ended requests
    whose release waits until none does."""

    def __init__(self):
        self.flights: dict[int, Flight] = {}  # by step id
        self._holders: dict[Req, int] = {}  # request -> how many launched steps hold it (> 0)
        self._future_ids = itertools.count()
        # Ended requests whose release waits until no launched step holds them (``Scheduler._finish``).
        self.releasing: list[Req] = []

    def launch(self, sched: SchedulerOutput, reqs: list[Req], drafting: bool) -> None:
        """Advance every overlappable row as if its step were done and record the step as in flight
        (``reqs``: the rows' requests; ``drafting``: a proposer drafts from the output, so no row
        samples ahead of it)."""
        overlapped = []
        for req, sr in zip(reqs, sched.reqs):
            ok = _overlappable(req, sr, drafting)
            overlapped.append(ok)
            self._holders[req] = self._holders.get(req, 0) + 1
            if not ok:
                continue
            req.kv_len = sr.start + sr.num_tokens
            if sr.sampling is not None:
                sr.future = next(self._future_ids)
                req.output_ids.append(placeholder(sr.future))
        self.flights[sched.step] = Flight(list(reqs), overlapped, [sr.start for sr in sched.reqs])

    def land(self, step: int) -> Flight | None:
        """Step ``step``'s result is in: the step no longer holds its requests. None for a step that
        was not launched ahead (a synchronous one)."""
        flight = self.flights.pop(step, None)
        if flight is not None:
            for req in flight.reqs:
                self._holders[req] -= 1
                if not self._holders[req]:
                    del self._holders[req]
        return flight

    def holds(self, req: Req) -> bool:
        """A launched step still computes ``req``."""
        return bool(self._holders.get(req))

    def earliest_starts(self) -> dict[Req, int]:
        """Each request's earliest position that a launched step computes."""
        earliest: dict[Req, int] = {}
        for f in self.flights.values():
            for r, a in zip(f.reqs, f.starts):
                earliest[r] = min(earliest.get(r, a), a)
        return earliest

    @property
    def needs_sync(self) -> bool:
        """A launched step's result must be applied before the next schedule."""
        return any(f.blocks_next for f in self.flights.values())

    def __len__(self) -> int:
        return len(self.flights)


def ends_pending(req: Req, context_length: int) -> bool:
    """The token a launched step is sampling for ``req`` surely ends it (its last allowed token, or
    the context's end): nothing more is scheduled for it."""
    ids = req.output_ids
    return (
        bool(ids)
        and is_placeholder(ids[-1])
        and (len(ids) >= req.params.max_new_tokens or req.seq_len >= context_length)
    )


def _overlappable(req: Req, sr: ScheduledReq, drafting: bool) -> bool:
    if sr.num_draft or sr.prompt_lp_targets or sr.pool_from >= 0 or sr.label_token_ids:
        return False
    if sr.sampling is None:
        return sr.start + sr.num_tokens < req.seq_len  # a prompt chunk short of the end
    return req.grammar is None and not drafting


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
