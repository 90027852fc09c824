"""The scheduler: intake, the safe points, the one release path, and the two halves of a step.

``schedule()``: take in new requests and aborts; SAFE POINT (finish every marked request); pick the
batch (``policy.py``) and describe it as a ``SchedulerOutput``.
``update(sched, result)``: apply the executor's ``ModelRunnerOutput`` (0..k tokens per request,
stop checks in ``stop.py``, rejected drafts given back with ``truncate``); SAFE POINT again; the
ledger check (every step in strict mode) and the idle audit. Returns the step's ``RequestOutput``s.

Its parts, one job each: ``intake.py`` (checks, queueing, aborts, timeouts, the grammar compile
wait), ``rows.py`` (the batch described for the executor), ``results.py`` (a step's results applied
to its requests), ``overlap.py`` (steps launched ahead), ``books.py`` (holdings and the books check),
``pause.py`` (``/pause_generation``'s modes).

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
import time
from collections import deque
from collections.abc import Callable, Iterable

from ..common import RequestOutput
from ..config import EngineConfig
from ..connector import KVConnector, NoOpConnector
from ..memory import Holding, KVManager
from .books import SchedulerBooks
from .images import EncoderCacheBooks, ImageBooks
from .intake import TIMEOUT_CODE, Intake, drop_grammar
from .output import ModelRunnerOutput, SchedulerOutput
from .overlap import InFlight, strip_placeholders
from .pause import pause
from .policy import BatchPolicy
from .request import Req, ReqState, SpecState
from .results import ResultApplier, final_output
from .rows import StepStats, scheduled_row
from .stop import StopChecker

log = logging.getLogger(__name__)

# Called with every request that ends, before its KV is released; True keeps its pages until the
# component reports it is done with them (a KV connector's async save).
ReleaseHook = Callable[[Req], bool | None]


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
        image_bytes_per_token: int = 0,
    ):
        """``image_bytes_per_token``: a vision model's embedding row in bytes (the encoder cache's
        unit; 0: a text-only model)."""
        self.cfg = cfg
        self.vocab_size = vocab_size  # the width of token bitmasks (min_new_tokens)
        self.kv_manager = kv_manager
        self.context_length = context_length
        self.connector = connector or NoOpConnector()
        self.proposer = proposer  # drafts for speculative decoding: ``propose(req) -> list[int]``
        self.stop = StopChecker(eos_token_ids, context_length, decode)
        self.policy = BatchPolicy(self)
        self.intake = Intake(self)  # checks, queueing, aborts, timeouts
        self.last_arrival = 0  # the newest request's arrival_seq
        self.books = SchedulerBooks(self)  # holdings, live arrivals, the books checked after each step
        # Quarantined pages wait until every request live when they were found has ended (ledger.py).
        kv_manager.ledger.arrivals = self.books.arrival_span
        self.waiting: deque[Req] = deque()
        self.compiling: list[Req] = []  # waiting for their grammar (GrammarJob), in arrival order
        self.running: list[Req] = []
        self.waiting_for_kv: list[Req] = []
        self.sending: dict[str, Req] = {}
        self.reqs: dict[str, Req] = {}  # every request the engine knows, queued or live
        self._outputs: list[RequestOutput] = []
        # Components with per-request state register here; ``_finish`` calls each on every ending.
        # Image embeddings the runner holds between a request's chunks, and its encoder cache.
        self.images = ImageBooks(
            kv_manager.sessions, EncoderCacheBooks(cfg.cache.encoder_cache_bytes, image_bytes_per_token)
        )
        kv_manager.ledger.images = self.images  # (audited with the pages: every holder a live request)
        self.release_hooks: list[ReleaseHook] = [self.connector.request_finished, drop_grammar, self.images.release]
        self.last_stats = StepStats()
        self.spec_totals = SpecState()  # every verify step of every request
        self.results = ResultApplier(self.stop, kv_manager, self.spec_totals)  # a step's rows applied
        self.total_retractions = 0
        self.clock: Callable[[], float] = time.monotonic  # request deadlines (a test may drive it)
        self.paused: str | None = None  # the pause mode (PAUSE_MODES) while generation is paused
        # Overlap scheduling (``overlap.py``; on where the engine overlaps its steps): steps launched
        # and not yet updated, how many of them hold each request, and finished requests whose
        # release waits until none does.
        self.overlap = overlap
        self._step_ids = itertools.count(1)
        self.in_flight = InFlight()

    # -- intake ---------------------------------------------------------------------------------------
    def check_submit(self, req: Req) -> None:
        """The engine's one duplicate-rid check, and the queue limits (``Intake.check``)."""
        self.intake.check(req)

    def submit(self, req: Req) -> None:
        """Queue a validated request (call ``check_submit`` first). On the engine's thread."""
        self.intake.submit(req)

    def abort(
        self, rid: str, message: str = "aborted by the client", status: int = 200, code: str | None = None
    ) -> None:
        """Mark ``rid`` for abort at the next safe point (any thread). ``status`` >= 400 makes it an
        error for a client that has seen no output yet (a failed KV transfer: 502)."""
        self.intake.abort(rid, message, status, code)

    def settle(self) -> None:
        """Take in pending aborts and timeouts, and finish what they marked. Only between steps."""
        self.intake.mark_ends()
        live = (self.running, self.waiting, self.waiting_for_kv, self.compiling)
        for r in [r for r in itertools.chain(*live) if r.to_finish]:
            self._finish(r)

    # -- pause ----------------------------------------------------------------------------------------
    def pause(self, mode: str) -> int:
        """Stop stepping requests until ``resume``, in one of ``PAUSE_MODES`` (``pause.py``); between
        steps only. Returns how many requests the engine holds paused."""
        return pause(self, mode)

    def resume(self) -> None:
        """Generation continues where ``pause`` left it (retracted requests are admitted again)."""
        self.paused = None

    # -- ledger view ----------------------------------------------------------------------------------
    def holdings(self) -> Iterable[Holding]:
        """What every session and live request holds, for the ledger's audit (``books.py``)."""
        return self.books.holdings()

    @property
    def has_requests(self) -> bool:
        return (
            bool(self.running or self.waiting or self.compiling or self.waiting_for_kv or self.sending)
            or bool(self.in_flight.releasing)
            or not self.intake.inbox.empty()
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
        # (Image embeddings of ended requests still held by the runner: one more step drops them.)
        return (
            not self.has_requests
            and not self.connector.has_pending
            and not (sparse and sparse.has_pending)
            and not self.images.has_drops
        )

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
        self._outputs.append(final_output(req, reason))
        if hold and req.slot is not None:
            req.state = ReqState.SENDING  # released when the connector reports the save done
            self.sending[req.rid] = req
            return
        if self.in_flight.holds(req):
            # (overlap) a launched step still computes it: its pages go back once that step's result
            # is in (and dropped), so no forward writes pages another request was given. For its
            # client it has ended: its rid is free (an abort of it is refused, the rid may be reused).
            req.state = ReqState.SENDING
            self.in_flight.releasing.append(req)
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
        out = SchedulerOutput(
            [scheduled_row(c, self.stop, self.vocab_size, self.overlap) for c in chunks],
            self.kv_manager.take_page_writes(),
        )
        for c, row in zip(chunks, out.reqs):
            row.images = self.images.feeds(c.req, row.start, row.start + row.num_tokens)
            rope = c.req.mm.rope if c.req.mm is not None else None
            if rope is not None:  # the rows' M-RoPE positions: from their indices, wherever the chunk starts
                row.rope_delta, row.mrope = rope.chunk(row.start, row.start + row.num_tokens)
        out.image_drops = self.images.take_drops()
        out.step = next(self._step_ids)
        if self.kv_manager.sparse is not None:
            rows = [c.req.slot for c in chunks if c.req.sparse is not None and c.req.sparse.active]
            out.hisparse = self.kv_manager.sparse.take_step(rows, out.step)
        out.connector_meta = self.connector.build_connector_meta(out)
        if self.overlap and chunks:
            self.in_flight.launch(out, [c.req for c in chunks], drafting=self.proposer is not None)
        if chunks:
            self.books.was_busy = True
            self.last_stats.record(out, chunks)
        return out

    def _slide_windows(self) -> None:
        """Sliding-window models (``memory/window.py``): every running request gives back the pages
        that no query of its own reads again: those outside the window of its next position, or of the
        earliest position a launched step still computes for it (overlap). Before the batch is built,
        so the pages serve this step's allocations."""
        kvm = self.kv_manager
        if kvm.window is None:
            return
        earliest = self.in_flight.earliest_starts()
        for r in self.running:
            kvm.slide_window(r, min(r.kv_len, earliest.get(r, r.kv_len)))

    # -- a step, second half ----------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput | None) -> list[RequestOutput]:
        flight = self.in_flight.land(sched.step)
        if result is not None:
            self._outputs.extend(self.results.apply_rows(sched, result, flight, self.reqs))
            self._connector_done(result)
        for req in [r for r in self.in_flight.releasing if not self.in_flight.holds(r)]:
            self.in_flight.releasing.remove(req)
            self._release(req)
        if self.kv_manager.sparse is not None:
            self.kv_manager.sparse.drop_begun(sched.step)  # the step's begun: their prompt KV is in host pages
        self.connector.step_finished()
        self.settle()
        self.books.check()
        out, self._outputs = self._outputs, []
        return out

    # -- overlap: launching a step before the previous one's result ---------------------------------------
    @property
    def releasing(self) -> list[Req]:
        """(overlap) Ended requests whose pages go back once no launched step holds them."""
        return list(self.in_flight.releasing)

    @property
    def needs_sync(self) -> bool:
        """A launched step's result must be applied before the next schedule (``overlap.py``)."""
        return self.in_flight.needs_sync

    def keep_outputs(self, outs: list[RequestOutput]) -> None:
        """Outputs produced between steps (the engine waited for a launched step before a control
        call): the next ``update`` returns them first."""
        self._outputs[:0] = outs

    def _connector_done(self, result: ModelRunnerOutput) -> None:
        for rid in result.finished_recving:
            req = self.reqs.get(rid)
            if req is not None and req.state is ReqState.WAITING_FOR_KV:
                self.waiting_for_kv.remove(req)
                req.kv_len += req.num_external_tokens
                req.num_external_tokens = 0
                req.state = ReqState.RUNNING
                self.running.append(req)
                if (out := self.results.join_received(req, self.connector)) is not None:
                    self._outputs.append(out)
        # A finished request whose pages the connector held (a save, or a load it had to drain).
        for rid in result.finished_sending | result.finished_recving:
            req = self.sending.get(rid)
            if req is not None:
                self._release(req)
