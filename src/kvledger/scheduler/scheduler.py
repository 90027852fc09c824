"""The scheduler: intake, the safe points, the one release path, and the two halves of a step.

``schedule()``: take in new requests and aborts; SAFE POINT (finish every marked request); pick the
batch (``policy.py``) and describe it as a ``SchedulerOutput``.
``update(sched, result)``: apply the executor's ``ModelRunnerOutput`` (0..k tokens per request,
stop checks in ``stop.py``, rejected drafts given back with ``truncate``); SAFE POINT again; the
ledger check (every step in strict mode) and the idle audit. Returns the step's ``RequestOutput``s.

A request with a grammar waits in ``compiling`` (holding nothing, like a queued one) while its grammar
compiles on the grammar backend's threads; ``settle`` moves it to the queue once compiled, or ends it
(a grammar that does not compile, or not in time). The engine's thread never compiles.

Paused (``pause``: SGLang's ``/pause_generation``), ``schedule()`` still takes in aborts and
timeouts and finishes what they marked, but picks no batch: nothing is admitted or computed until
``resume``.

Causes never free memory themselves: they call ``Req.mark_finish``. ``_finish`` is the one release
path: it tells every registered component (``release_hooks``, the KV connector), then
``KVManager.release`` commits or frees the request's KV, then the final output is emitted. It never
stops in the middle: each hook and the memory release run under ``Ledger.contain`` (a failure is
logged and counted in ``memory.leak_check.contained_errors``, and the next step runs); strict mode
raises it (``ReleaseError``) at the step's books check, once the release has completed.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ..common import FinishReason, RequestOutput
from ..common.pooling import normalized
from ..config import EngineConfig
from ..connector import KVConnector, NoOpConnector
from ..constrained import bitmask_width, grammar_spec
from ..errors import ConflictError, KVLedgerError, OverloadedError, ServiceUnavailable, ValidationError
from ..memory import Holding, KVManager
from ..memory.sparse_kv import SparseKV
from .output import ModelRunnerOutput, SamplingRow, ScheduledReq, SchedulerOutput
from .overlap import Flight, is_placeholder, placeholder, strip_placeholders
from .policy import BatchPolicy, Chunk
from .request import Req, ReqState, SpecState
from .stop import StopChecker

log = logging.getLogger(__name__)

# Called with every request that ends, before its KV is released; True keeps its pages until the
# component reports it is done with them (a KV connector's async save).
ReleaseHook = Callable[[Req], bool | None]


@dataclass
class StepStats:
    num_tokens: int = 0
    num_decode: int = 0
    num_prefill_tokens: int = 0
    num_retracted: int = 0


class Scheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        kv_manager: KVManager,
        context_length: int,
        eos_token_ids: Iterable[int],
        decode: Callable[[list[int]], str] | None = None,
        connector: KVConnector | None = None,
        proposer=None,
        vocab_size: int = 0,
        overlap: bool = False,
    ):
        self.cfg = cfg
        self.vocab_size = vocab_size  # the width of token bitmasks (min_new_tokens)
        self.kv_manager = kv_manager
        self.context_length = context_length
        self.connector = connector or NoOpConnector()
        self.proposer = proposer  # drafts for speculative decoding: ``propose(req) -> list[int]``
        self.stop = StopChecker(eos_token_ids, context_length, decode)
        self.policy = BatchPolicy(self)
        self._arrivals = itertools.count(1)
        self.last_arrival = 0  # the newest request's arrival_seq
        # Quarantined pages wait until every request live when they were found has ended (ledger.py).
        kv_manager.ledger.arrivals = self._arrival_span
        self.waiting: deque[Req] = deque()
        self.compiling: list[Req] = []  # waiting for their grammar (GrammarJob), in arrival order
        self.running: list[Req] = []
        self.waiting_for_kv: list[Req] = []
        self.sending: dict[str, Req] = {}
        self.reqs: dict[str, Req] = {}  # every request the engine knows, queued or live
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # aborts may come from any thread
        self._outputs: list[RequestOutput] = []
        # Components with per-request state register here; ``_finish`` calls each on every ending.
        self.release_hooks: list[ReleaseHook] = [self.connector.request_finished, _drop_grammar]
        self.last_stats = StepStats()
        self.spec_totals = SpecState()  # every verify step of every request
        self.total_retractions = 0
        self._last_audit = 0.0
        self._was_busy = False
        self.clock: Callable[[], float] = time.monotonic  # request deadlines (a test may drive it)
        self.paused: str | None = None  # the pause mode (PAUSE_MODES) while generation is paused
        # Overlap scheduling (``overlap.py``; on where the engine overlaps its steps): steps launched
        # and not yet updated, how many of them hold each request, and finished requests whose
        # release waits until none does.
        self.overlap = overlap
        self._step_ids = itertools.count(1)
        self._future_ids = itertools.count()
        self._flights: dict[int, Flight] = {}
        self._in_flight: dict[Req, int] = {}
        self._release_later: list[Req] = []

    # -- intake ---------------------------------------------------------------------------------------
    def check_submit(self, req: Req) -> None:
        """The engine's one duplicate-rid check, and the queue limits (429): requests, and prompt tokens
        waiting to be prefilled. Before anything is held."""
        rid, sc = req.rid, self.cfg.scheduler
        if rid in self.reqs:
            raise ConflictError(
                f"a request with id {rid!r} is already running", param="rid", code="duplicate_rid"
            )
        if len(self.waiting) + len(self.compiling) >= sc.max_queued_requests:
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
        sparse = self.kv_manager.sparse
        if sparse is not None and (why := sparse.too_big(req)):
            raise ValidationError(why, param="max_tokens", code="hisparse_host_pool_too_small")
        budget = sc.max_queued_prefill_tokens
        if budget is not None and (self.waiting or self.compiling):
            # A prompt longer than the budget is still taken when nothing waits: refusing it would be
            # for ever, and one request alone is what max_queued_requests=1 allows too.
            queued = sum(r.seq_len - r.kv_len for r in itertools.chain(self.waiting, self.compiling))
            if queued + len(req.input_ids) > budget:
                raise OverloadedError(
                    f"the waiting queue holds {queued} prompt tokens; {len(req.input_ids)} more would pass "
                    f"its budget of {budget} (--max-queued-prefill-tokens); retry later",
                    code="queue_full",
                )

    def submit(self, req: Req) -> None:
        """Queue a validated request (call ``check_submit`` first). On the engine's thread."""
        self.reqs[req.rid] = req
        req.arrival_seq = self.last_arrival = next(self._arrivals)
        req.priority_rank = self.policy.order.rank(req)
        limits = [t for t in (req.params.timeout, self.cfg.scheduler.request_timeout_s) if t is not None]
        if limits:
            req.timeout_s = min(limits)
            req.deadline = self.clock() + req.timeout_s
        (self.compiling if req.grammar_job is not None else self.waiting).append(req)
        if req.params.scoring and req.next_prompt_logprob is None and req.pooling is None:
            req.mark_finish(FinishReason("length"))  # nothing to compute (scoring still runs the prompt)
        else:
            self.connector.request_queued(req)

    def abort(
        self, rid: str, message: str = "aborted by the client", status: int = 200, code: str | None = None
    ) -> None:
        """Mark ``rid`` for abort at the next safe point (any thread). ``status`` >= 400 makes it an
        error for a client that has seen no output yet (a failed KV transfer: 502)."""
        self._inbox.put((rid, message, status, code))

    def settle(self) -> None:
        """Take in pending aborts and timeouts, and finish what they marked. Only between steps."""
        while True:
            try:
                rid, message, status, code = self._inbox.get_nowait()
            except queue.Empty:
                break
            r = self.reqs.get(rid)
            if r is not None:
                r.mark_finish(FinishReason("abort", message, status=status, code=code))
        now = self.clock()
        if self.compiling:
            self._take_compiled()
        live = (self.running, self.waiting, self.waiting_for_kv, self.compiling)
        for r in itertools.chain(*live):
            if r.deadline is not None and now >= r.deadline:
                r.mark_finish(_timed_out(r))
        for r in [r for r in itertools.chain(*live) if r.to_finish]:
            self._finish(r)

    def _take_compiled(self) -> None:
        """Requests whose grammar is compiled join the queue (in arrival order); one whose grammar
        failed to compile, or passed its compile deadline, is marked to end with that 400."""
        still = []
        for r in self.compiling:
            if r.to_finish is not None:
                still.append(r)  # ends below (settle); its job is cancelled by the release hook
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
            self.waiting.append(r)
        self.compiling = still

    # -- pause ----------------------------------------------------------------------------------------
    def pause(self, mode: str) -> int:
        """Stop stepping requests until ``resume``; between steps only (a safe point).

        ``abort``: every request is marked, and ends at the next step's safe point through the
        release path (finish reason abort; that step's update emits the outputs). ``retract``: every
        running request is retracted as when the pool runs short (its computed KV committed to the
        prefix cache; a session turn's own pages freed) and requeued in its order, its output so far
        kept, to be recomputed on resume. ``in_place``: requests keep their slots and KV where they
        are. Requests waiting on a KV connector are left to it. Returns how many requests the engine
        holds paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}")
        self.paused = mode
        if mode == "abort":
            for r in self.reqs.values():
                r.mark_finish(FinishReason("abort", "aborted by /pause_generation (mode abort)"))
            return 0
        if mode == "retract":
            # Newest first: each goes to the front of the queue, so the oldest ends up first.
            for r in sorted(self.running, key=lambda r: r.admitted_seq, reverse=True):
                self.policy.retract(r)
        return len(self.reqs)

    def resume(self) -> None:
        """Generation continues where ``pause`` left it (retracted requests are admitted again)."""
        self.paused = None

    # -- ledger view ----------------------------------------------------------------------------------
    def holdings(self) -> Iterable[Holding]:
        yield from self.kv_manager.sessions.holdings()
        for r in itertools.chain(self.running, self.waiting_for_kv, self.sending.values(), self._release_later):
            yield self.kv_manager.holding(r)
            if r.sparse is not None:
                yield from SparseKV.holdings(r)

    def _arrival_span(self) -> tuple[int, int | None]:
        """(the newest arrival so far, the oldest arrival of a request still live or None): every
        request that may hold or reach pages, those released after a launched step included."""
        live = [r.arrival_seq for r in itertools.chain(self.reqs.values(), self._release_later)]
        return self.last_arrival, min(live, default=None)

    @property
    def has_requests(self) -> bool:
        return (
            bool(self.running or self.waiting or self.compiling or self.waiting_for_kv or self.sending)
            or bool(self._release_later)
            or not self._inbox.empty()
        )

    @property
    def has_outputs(self) -> bool:
        """Outputs of requests finished between steps (a control call settled them), not yet emitted:
        the next step's ``update`` returns them."""
        return bool(self._outputs)

    @property
    def idle(self) -> bool:
        # (HiSparse's ends still queued for the worker: one more step drops the slots' state.)
        sparse = self.kv_manager.sparse
        return not self.has_requests and not self.connector.has_pending and not (sparse and sparse.has_pending)

    @property
    def has_pending_kv(self) -> bool:
        """Requests waiting on the connector (a load to arrive, a save to end), or the connector's own
        async work (the hierarchical cache's file I/O)."""
        return bool(self.waiting_for_kv or self.sending) or self.connector.has_pending

    # -- the one release path -------------------------------------------------------------------------
    def _finish(self, req: Req) -> None:
        reason = req.to_finish
        if reason is None:
            raise RuntimeError(f"request {req.rid} is finished without being marked (mark_finish)")
        strip_placeholders(req)  # (overlap) tokens it will not receive are not its output
        hold = False
        contain = self.kv_manager.ledger.contain
        for hook in self.release_hooks:
            # A faulty component must not stop the release: logged, counted, the next step runs (a
            # failed hook keeps nothing: it cannot report a save done).
            name = getattr(hook, "__qualname__", repr(hook))
            hold |= bool(contain(f"release hook {name} for req {req.rid}", hook, req))
        if req.state is ReqState.RUNNING:
            self.running.remove(req)
        elif req.state is ReqState.WAITING_FOR_KV:
            self.waiting_for_kv.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.compiling:
            self.compiling.remove(req)
        req.finish_reason = reason
        out = RequestOutput.final(req.rid, reason, len(req.input_ids), len(req.output_ids), req.cached_tokens)
        out.spec_verify_ct = req.spec.verify_ct
        if req.pooling is not None and reason.type != "abort":
            if req.pooled is not None:
                out.embedding = normalized(req.pooled, req.pooled_count, req.pooling.mean)
            out.label_logprobs = req.label_logprobs
        self._outputs.append(out)
        if hold and req.slot is not None:
            req.state = ReqState.SENDING  # released when the connector reports the save done
            self.sending[req.rid] = req
            return
        if self._in_flight.get(req):
            # (overlap) a launched step still computes it: its pages go back once that step's result
            # is in (and dropped), so no forward writes pages another request was given. For its
            # client it has ended: its rid is free (an abort of it is refused, the rid may be reused).
            req.state = ReqState.SENDING
            self._release_later.append(req)
            if self.reqs.get(req.rid) is req:
                del self.reqs[req.rid]
            return
        self._release(req)

    def _release(self, req: Req) -> None:
        reason = req.finish_reason
        # KV from a failed forward is not trusted for reuse; everything else is valid and cached (a
        # timeout's 503 included: its forwards succeeded, and a retry finds its prefix). A session
        # turn writes into its session only when it completed (never on abort).
        ok = reason.status < 500 or reason.code == TIMEOUT_CODE
        commit = reason.type != "abort" if req.session is not None else ok
        commit = commit and req.kv_trusted
        # (Contained: whatever it failed to give back, the request leaves; the audit finds the rest.)
        self.kv_manager.ledger.contain(f"req {req.rid}: its memory's release", self.kv_manager.release, req, commit)
        req.state = ReqState.FINISHED
        if self.sending.get(req.rid) is req:
            del self.sending[req.rid]
        if self.reqs.get(req.rid) is req:
            del self.reqs[req.rid]

    # -- a step, first half -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.settle()
        self.last_stats = StepStats()
        self._slide_windows()
        chunks = [] if self.paused else self.policy.schedule()
        out = SchedulerOutput([self._scheduled(c) for c in chunks], self.kv_manager.take_page_writes())
        if self.kv_manager.sparse is not None:
            rows = [c.req.slot for c in chunks if c.req.sparse is not None and c.req.sparse.active]
            out.hisparse = self.kv_manager.sparse.take_step(rows)
        out.connector_meta = self.connector.build_connector_meta(out)
        out.step = next(self._step_ids)
        if self.overlap and chunks:
            self._launch(out, chunks)
        if chunks:
            self._was_busy = True
            st = self.last_stats
            st.num_tokens = out.num_tokens
            st.num_decode = sum(1 for c in chunks if c.num_tokens == 1)
            st.num_prefill_tokens = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        return out

    def _slide_windows(self) -> None:
        """Sliding-window models (``memory/window.py``): every running request gives back the pages
        that no query of its own reads again: those outside the window of its next position, or of the
        earliest position a launched step still computes for it (overlap). Before the batch is built,
        so the pages serve this step's allocations."""
        kvm = self.kv_manager
        if kvm.window is None:
            return
        earliest: dict[Req, int] = {}
        for f in self._flights.values():
            for r, a in zip(f.reqs, f.starts):
                earliest[r] = min(earliest.get(r, a), a)
        for r in self.running:
            kvm.slide_window(r, min(r.kv_len, earliest.get(r, r.kv_len)))

    def _scheduled(self, c: Chunk) -> ScheduledReq:
        req, a = c.req, c.req.kv_len
        b = a + c.num_tokens
        sampling = None
        if b == req.seq_len:
            p = req.params
            pen = p.has_penalties
            # (overlap: a copy, for the list changes while the step runs; its placeholder is resolved
            # by the executor)
            hist = (list(req.output_ids) if self.overlap else req.output_ids) if pen else None
            sampling = SamplingRow(p, len(req.output_ids), req.input_ids if pen else None, hist)
        mask = None
        if sampling is not None:
            mask = req.grammar.masks(c.drafts) if req.grammar is not None else None
            mask = self._min_tokens_mask(req, len(c.drafts) + 1, mask)
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
            self._pooling_rows(req, sr, b)
        return sr

    @staticmethod
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

    def _min_tokens_mask(self, req: Req, rows: int, mask: np.ndarray | None) -> np.ndarray | None:
        """Below min_new_tokens the stop tokens are not drawn: their bits cleared in the rows of
        positions short of it (and'ed with a grammar's mask)."""
        short = req.params.min_new_tokens - len(req.output_ids)
        stop = self.stop.stop_ids(req) if short > 0 else []
        if not stop:  # (ignore_eos, no stop ids: nothing to hold back, so no all-ones mask per step)
            return mask
        if mask is None:
            mask = np.full((rows, bitmask_width(self.vocab_size)), -1, dtype=np.int32)
        bits = mask.view(np.uint32)
        for t in stop:
            bits[:short, t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        return mask

    # -- a step, second half ----------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput | None) -> list[RequestOutput]:
        flight = self._flights.pop(sched.step, None)
        if flight is not None:
            for req in flight.reqs:
                self._in_flight[req] -= 1
                if not self._in_flight[req]:
                    del self._in_flight[req]
        if result is not None:
            for i, sr in enumerate(sched.reqs):
                if flight is None:
                    self._apply(self.reqs[sr.rid], sr, result, i)
                    continue
                req = flight.reqs[i]
                if req.state in (ReqState.FINISHED, ReqState.SENDING):
                    continue  # (overlap) it ended after this step was launched: the row is dropped
                if flight.overlapped[i]:
                    self._apply_overlapped(req, sr, result, i)
                else:
                    self._apply(req, sr, result, i)
            self._connector_done(result)
        for req in [r for r in self._release_later if r not in self._in_flight]:
            self._release_later.remove(req)
            self._release(req)
        if self.kv_manager.sparse is not None:
            self.kv_manager.sparse.drop_begun()  # their prompt KV is in host pages now
        self.connector.step_finished()
        self.settle()
        self._check_books()
        out, self._outputs = self._outputs, []
        return out

    def _apply(self, req: Req, sr: ScheduledReq, result: ModelRunnerOutput, i: int) -> None:
        if result.errors is not None and result.errors[i] is not None:
            log.error("request %s failed: %s", req.rid, result.errors[i])
            msg = f"engine error while computing this request: {result.errors[i]}"
            req.mark_finish(FinishReason("abort", msg, status=500))
            return
        fed_end = sr.start + sr.num_tokens
        tokens = result.tokens[i]
        new_input = 0
        if sr.prompt_lp_targets and result.prompt_logprobs is not None:
            new_input = len(result.prompt_logprobs[i])
            req.input_logprobs.extend(result.prompt_logprobs[i])
            req.input_top_logprobs.extend(result.prompt_top_logprobs[i])
        if req.pooling is not None:
            self._take_pooled(req, sr, result, i)
        if not tokens:
            req.kv_len = fed_end - sr.num_draft
            if req.params.scoring and req.kv_len >= req.seq_len:
                req.mark_finish(FinishReason("length"))  # scored: nothing to generate
            if new_input:
                self._outputs.append(self._output(req, 0, new_input))
            return
        if sr.num_draft:
            req.spec.record(sr.num_draft, len(tokens) - 1)
            self.spec_totals.record(sr.num_draft, len(tokens) - 1)
        before = req.seq_len
        n = self.stop.append(req, tokens, result.logprobs[i], result.top_logprobs[i])
        if req.grammar is not None:
            self._advance_grammar(req, n)
        # Valid KV: what was fed up to the last accepted draft; the newest token is not in the KV yet.
        req.kv_len = min(fed_end, before + n - 1)
        if fed_end > req.kv_len:
            self.kv_manager.truncate(req, req.kv_len)  # rejected drafts' positions go back to the pool
        self._outputs.append(self._output(req, n, new_input))

    def _apply_overlapped(self, req: Req, sr: ScheduledReq, result: ModelRunnerOutput, i: int) -> None:
        """A row advanced at launch (``_launch``): its KV length is set already; a sampled token
        takes its placeholder's place, through the same stop checks as in ``_apply``. Tokens of later
        steps' placeholders stay after it unless this one ends the request."""
        if result.errors is not None and result.errors[i] is not None:
            self._apply(req, sr, result, i)  # the 500, as a synchronous step
            return
        if sr.future < 0:
            return  # a prefill chunk that samples nothing
        tokens, ids, ph = result.tokens[i], req.output_ids, placeholder(sr.future)
        if ph not in ids:
            return  # an earlier result re-planned the request (below): this row is dropped
        k = len(ids) - 1 - ids[::-1].index(ph)
        later = ids[k + 1 :]
        del ids[k:]
        if len(tokens) != 1:
            # Not the one token the next step was planned on (an executor may give 0..k, seams): the
            # later placeholders go (their rows are dropped) and the request goes on from the KV this
            # row computed, as after a synchronous step (a jump forward computes the rest next).
            if req.state is ReqState.RUNNING:
                req.kv_len = min(req.kv_len, sr.start + sr.num_tokens)
                self._apply(req, sr, result, i)
                return
            later = []
        n = self.stop.append(req, tokens, result.logprobs[i], result.top_logprobs[i])
        if req.grammar is not None:
            self._advance_grammar(req, n)
        self._outputs.append(self._output(req, n, 0))
        if req.to_finish is None:
            ids.extend(later)

    # -- overlap: launching a step before the previous one's result ---------------------------------------
    def _launch(self, sched: SchedulerOutput, chunks: list[Chunk]) -> None:
        """Advance every overlappable row as if its step were done (``overlap.py``) and record the
        step as in flight."""
        overlapped = []
        for c, sr in zip(chunks, sched.reqs):
            req = c.req
            ok = self._overlappable(req, sr)
            overlapped.append(ok)
            self._in_flight[req] = self._in_flight.get(req, 0) + 1
            if not ok:
                continue
            req.kv_len = sr.start + sr.num_tokens
            if sr.sampling is not None:
                sr.future = next(self._future_ids)
                req.output_ids.append(placeholder(sr.future))
        self._flights[sched.step] = Flight([c.req for c in chunks], overlapped, [sr.start for sr in sched.reqs])

    def _overlappable(self, req: Req, sr: ScheduledReq) -> bool:
        if sr.num_draft or sr.prompt_lp_targets or sr.pool_from >= 0 or sr.label_token_ids:
            return False
        if sr.sampling is None:
            return sr.start + sr.num_tokens < req.seq_len  # a prompt chunk short of the end
        return req.grammar is None and self.proposer is None

    @property
    def releasing(self) -> list[Req]:
        """(overlap) Ended requests whose pages go back once no launched step holds them."""
        return list(self._release_later)

    @property
    def steps_in_flight(self) -> int:
        return len(self._flights)

    @property
    def needs_sync(self) -> bool:
        """A launched step's result must be applied before the next schedule (``overlap.py``)."""
        return any(f.blocks_next for f in self._flights.values())

    def ends_pending(self, req: Req) -> bool:
        """(overlap) The token a launched step is sampling for ``req`` surely ends it (its last
        allowed token, or the context's end): nothing more is scheduled for it."""
        ids = req.output_ids
        return (
            bool(ids)
            and is_placeholder(ids[-1])
            and (len(ids) >= req.params.max_new_tokens or req.seq_len >= self.context_length)
        )

    def keep_outputs(self, outs: list[RequestOutput]) -> None:
        """Outputs produced between steps (the engine waited for a launched step before a control
        call): the next ``update`` returns them first."""
        self._outputs[:0] = outs

    @staticmethod
    def _take_pooled(req: Req, sr: ScheduledReq, result: ModelRunnerOutput, i: int) -> None:
        """Mean pooling adds this chunk's rows to the sum (positions ``start + pool_from`` to the chunk's
        end); last pooling keeps the last position's; a score keeps the label logprobs."""
        if sr.pool_from >= 0 and result.pooled is not None and result.pooled[i] is not None:
            end = sr.start + sr.num_tokens
            if req.pooling.mean:
                if sr.start + sr.pool_from != req.pooled_count:
                    raise RuntimeError(f"request {req.rid}: mean pooling skipped positions")
                req.pooled = result.pooled[i] if req.pooled is None else req.pooled + result.pooled[i]
            else:
                req.pooled = result.pooled[i]
            req.pooled_count = end
        if sr.label_token_ids and result.label_logprobs is not None:
            req.label_logprobs = result.label_logprobs[i]

    @staticmethod
    def _output(req: Req, n: int, new_input: int) -> RequestOutput:
        """This step's news for ``req``: its last ``n`` output tokens and ``new_input`` prompt logprobs."""
        out = RequestOutput(
            req.rid,
            req.output_ids[len(req.output_ids) - n :],
            req.output_logprobs[len(req.output_logprobs) - n :],
            req.output_top_logprobs[len(req.output_top_logprobs) - n :],
            False,
            None,
            len(req.input_ids),
            len(req.output_ids),
            req.cached_tokens,
            req.spec.verify_ct,
        )
        if new_input:
            k = len(req.input_logprobs) - new_input  # (token 0's None is the reader's to add)
            out.input_logprobs = req.input_logprobs[k:]
            out.input_top_logprobs = req.input_top_logprobs[k:]
        return out

    def _advance_grammar(self, req: Req, n: int) -> None:
        """The matcher follows the tokens the request kept; a grammar that has ended (its stop token
        accepted, e.g. under ignore_eos) ends the request."""
        kept = req.output_ids[-n:]
        if not req.grammar.accept(kept):
            log.error("request %s: the grammar refused a token it allowed (%s)", req.rid, kept)
            req.mark_finish(
                FinishReason("abort", "structured output failed: a token broke the grammar", status=500)
            )
        elif req.grammar.terminated:
            req.mark_finish(FinishReason("stop", matched=kept[-1]))
        elif req.grammar.too_slow:
            req.mark_finish(_grammar_too_slow(req))

    def _connector_done(self, result: ModelRunnerOutput) -> None:
        for rid in result.finished_recving:
            req = self.reqs.get(rid)
            if req is not None and req.state is ReqState.WAITING_FOR_KV:
                self.waiting_for_kv.remove(req)
                req.kv_len += req.num_external_tokens
                req.num_external_tokens = 0
                req.state = ReqState.RUNNING
                self.running.append(req)
                self._join_received(req)
        # A finished request whose pages the connector held (a save, or a load it had to drain).
        for rid in result.finished_sending | result.finished_recving:
            req = self.sending.get(rid)
            if req is not None:
                self._release(req)

    def _join_received(self, req: Req) -> None:
        """A request whose whole prompt's KV arrived takes the remote side's first token (PD's
        "prebuilt" step: no forward). The stop checks run on it like on any token, so a request it
        ends (max_new_tokens 1, EOS) finishes at the next safe point through the one release path,
        every release hook included (seed 003). Without a token the last prompt position is
        recomputed here."""
        got = self.connector.received_output(req) if req.kv_len >= req.seq_len else None
        if got is None:
            req.kv_len = min(req.kv_len, req.seq_len - 1)
            return
        # Served from a cache: decode's own prefix match, or prefill's where it reached further.
        req.cached_tokens = max(req.cached_tokens, got.cached_tokens)
        n = self.stop.append(req, got.tokens, got.logprobs, got.top_logprobs)
        if req.grammar is not None:
            self._advance_grammar(req, n)
        req.kv_len = req.seq_len - 1
        self._outputs.append(self._output(req, n, 0))

    def _check_books(self) -> None:
        """After the step's last safe point: conservation (every step in strict mode); a full audit
        each time the engine goes idle, and every ``audit_interval_s`` while it is busy."""
        ledger = self.kv_manager.ledger
        if ledger.strict:
            ledger.check_conservation()
        now = time.monotonic()
        if self.idle:
            if self._was_busy:
                self._was_busy = False
                self._last_audit = now
                ledger.audit()
        elif 0 < self.cfg.cache.audit_interval_s <= now - self._last_audit:
            self._last_audit = now
            ledger.audit()


TIMEOUT_CODE = "request_timeout"
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's; its default is abort


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


def _drop_grammar(req: Req) -> None:
    """Release hook: a request's grammar matcher goes with it (a compile not started yet never starts)."""
    req.grammar = None
    if req.grammar_job is not None:
        req.grammar_job.cancel()
        req.grammar_job = None


def _grammar_too_slow(req: Req) -> FinishReason:
    """A request whose grammar costs the engine's thread too much per token (``constrained/grammar.py``,
    MASK_CPU_LIMIT_S): it ends before it slows every other request's steps further."""
    spec = grammar_spec(req.params)
    return FinishReason.from_error(req.grammar.too_slow_error(spec.kind if spec is not None else "grammar"))
