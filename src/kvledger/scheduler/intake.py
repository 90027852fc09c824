"""Intake: how requests enter the scheduler's queues, and the causes that mark them to end between steps.

``check`` is the engine's one duplicate-rid check and the queue limits (429), before anything is held;
``submit`` queues a checked request (its arrival number, priority rank and deadline); ``abort`` takes an
abort from any thread into an inbox. At each safe point ``mark_ends`` marks what those causes ask for:
the inbox's aborts, grammars that failed to compile (a request with a grammar waits in ``compiling``,
holding nothing, until its grammar compiles, then joins the queue), and deadlines passed. It only marks
(``Req.mark_finish``): the scheduler finishes marked requests through the one release path.
"""

from __future__ import annotations

import itertools
import queue

from ..common import FinishReason
from ..errors import ConflictError, KVLedgerError, OverloadedError, ServiceUnavailable, ValidationError
from .request import Req, ReqState

TIMEOUT_CODE = "request_timeout"


class Intake:
    def __init__(self, sched):
        self.s = sched  # the Scheduler: its queues, request table, KVManager, connector, config, clock
        self._arrivals = itertools.count(1)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # aborts may come from any thread

    def check(self, req: Req) -> None:
        """The engine's one duplicate-rid check, and the queue limits (429): requests, and prompt tokens
        waiting to be prefilled. Before anything is held."""
        s = self.s
        rid, sc = req.rid, s.cfg.scheduler
        if rid in s.reqs:
            raise ConflictError(
                f"a request with id {rid!r} is already running", param="rid", code="duplicate_rid"
            )
        if len(s.waiting) + len(s.compiling) >= sc.max_queued_requests:
            raise OverloadedError(
                f"the waiting queue is full ({sc.max_queued_requests} requests); retry later",
                code="queue_full",
            )
        if req.params.priority is not None and not sc.enable_priority_scheduling and sc.abort_on_priority_when_disabled:
            raise ServiceUnavailable(  # SGLang's answer (503) under --abort-on-priority-when-disabled
                "using priority is disabled for this server (no --enable-priority-scheduling); send the "
                "request without a priority",
                param="priority",
                code="priority_disabled",
            )
        sparse = s.kv_manager.sparse
        if sparse is not None and (why := sparse.too_big(req)):
            raise ValidationError(why, param="max_tokens", code="hisparse_host_pool_too_small")
        budget = sc.max_queued_prefill_tokens
        if budget is not None and (s.waiting or s.compiling):
            # A prompt longer than the budget is still taken when nothing waits: refusing it would be
            # for ever, and one request alone is what max_queued_requests=1 allows too.
            queued = sum(r.seq_len - r.kv_len for r in itertools.chain(s.waiting, s.compiling))
            if queued + len(req.input_ids) > budget:
                raise OverloadedError(
                    f"the waiting queue holds {queued} prompt tokens; {len(req.input_ids)} more would pass "
                    f"its budget of {budget} (--max-queued-prefill-tokens); retry later",
                    code="queue_full",
                )

    def submit(self, req: Req) -> None:
        """Queue a checked request. On the engine's thread."""
        s = self.s
        s.reqs[req.rid] = req
        req.arrival_seq = s.last_arrival = next(self._arrivals)
        req.priority_rank = s.policy.order.rank(req)
        limits = [t for t in (req.params.timeout, s.cfg.scheduler.request_timeout_s) if t is not None]
        if limits:
            req.timeout_s = min(limits)
            req.deadline = s.clock() + req.timeout_s
        (s.compiling if req.grammar_job is not None else s.waiting).append(req)
        if req.params.scoring and req.next_prompt_logprob is None and req.pooling is None:
            req.mark_finish(FinishReason("length"))  # nothing to compute (scoring still runs the prompt)
        else:
            s.connector.request_queued(req)

    def abort(self, rid: str, message: str, status: int, code: str | None) -> None:
        self.inbox.put((rid, message, status, code))

    def mark_ends(self) -> None:
        """Mark the requests that pending aborts, failed grammars and passed deadlines end."""
        s = self.s
        while True:
            try:
                rid, message, status, code = self.inbox.get_nowait()
            except queue.Empty:
                break
            r = s.reqs.get(rid)
            if r is not None:
                r.mark_finish(FinishReason("abort", message, status=status, code=code))
        now = s.clock()
        if s.compiling:
            self._take_compiled()
        for r in itertools.chain(s.running, s.waiting, s.waiting_for_kv, s.compiling):
            if r.deadline is not None and now >= r.deadline:
                r.mark_finish(_timed_out(r))

    def _take_compiled(self) -> None:
        """Requests whose grammar is compiled join the queue (in arrival order); one whose grammar
        failed to compile, or passed its compile deadline, is marked to end with that 400."""
        s = self.s
        still = []
        for r in s.compiling:
            if r.to_finish is not None:
                still.append(r)  # ends at this safe point; its job is cancelled by the release hook
                continue
            try:
                grammar = r.grammar_job.poll()
            except KVLedgerError as e:
                r.mark_finish(FinishReason.from_error(e))
                still.append(r)
                continue
            if grammar is None:
                still.append(r)
                continue
            r.grammar, r.grammar_job = grammar, None
            s.waiting.append(r)
        s.compiling = still


def _timed_out(req: Req) -> FinishReason:
    """A request past its deadline: 503, as SGLang ends its waiting and running timeouts; what it
    generated stays (a stream has sent it; the final output counts it)."""
    where = "in the queue" if req.state is ReqState.WAITING and not req.output_ids else "while running"
    which = "its timeout" if req.params.timeout == req.timeout_s else "the server's --request-timeout-s"
    return FinishReason(
        "abort",
        f"the request timed out {where}: it took more than {req.timeout_s:g} s ({which})",
        status=503,
        code=TIMEOUT_CODE,
    )


def drop_grammar(req: Req) -> None:
    """Release hook: a request's grammar matcher goes with it (a compile not started yet never starts)."""
    req.grammar = None
    if req.grammar_job is not None:
        req.grammar_job.cancel()
        req.grammar_job = None
