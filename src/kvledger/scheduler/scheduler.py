"""Continuous-batching scheduler with chunked and mixed prefill, prefix reuse and retraction.

The loop (``step``):
  1. take new requests and aborts from the inbox (thread-safe);
  2. SAFE POINT: finish every marked request;
  3. build a batch: running decodes (retracting the newest requests when the pool cannot hold the
     next token) plus prefill chunks of admitted or newly admitted requests, within
     ``chunked_prefill_size``;
  4. run it, append sampled tokens, *mark* requests that reached a stop condition;
  5. SAFE POINT: finish every marked request; audit the books.
Causes never free memory themselves: they call ``Req.mark_finish``. ``_finish`` is the one release
path; it runs the registered release hooks, then ``KVManager.release``, then emits the final output.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..config import EngineConfig
from ..errors import ConflictError, OverloadedError
from ..memory import Holding
from .kv_manager import KVManager
from .request import FinishReason, Req, ReqState, StepOutput

log = logging.getLogger(__name__)

ReleaseHook = Callable[[Req], None]


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
        runner,
        kv: KVManager,
        context_length: int,
        eos_token_ids: Iterable[int],
        decode: Callable[[list[int]], str] | None = None,
    ):
        self.cfg = cfg
        self.runner = runner
        self.kv = kv
        self.context_length = context_length
        self.eos_token_ids = set(eos_token_ids)
        self.decode = decode
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_adds = 0
        self._outputs: list[StepOutput] = []
        self._admit_counter = itertools.count(1)
        self.release_hooks: list[ReleaseHook] = []
        self.sessions = None  # SessionManager, set by the engine core
        self.last_stats = StepStats()
        self.total_retractions = 0
        self._last_audit = 0.0
        self._was_busy = False

    # -- intake (any thread) ----------------------------------------------------------------------
    def check_capacity(self) -> None:
        """Raises 429 when the waiting queue is full."""
        if len(self.waiting) + self._pending_adds >= self.cfg.max_queued_requests:
            raise OverloadedError(
                f"the waiting queue is full ({self.cfg.max_queued_requests} requests); retry later",
                code="queue_full",
            )

    def submit(self, req: Req) -> None:
        """Queue a validated request. Raises 429 when the waiting queue is full."""
        self.check_capacity()
        self._pending_adds += 1
        self._inbox.put(("add", req))

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        self._inbox.put(("abort", (rid, message)))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._pending_adds -= 1
                req: Req = item
                if req.rid in self.reqs:
                    # The front checks too; this covers a race between two submissions.
                    req.mark_finish(FinishReason("abort", f"duplicate request id {req.rid!r}", status=409))
                    self._finish(req)  # never queued, but it may hold its session's turn
                    continue
                self.reqs[req.rid] = req
                self.waiting.append(req)
                if req.params.max_new_tokens == 0:
                    req.mark_finish(FinishReason("length"))
            else:
                rid, message = item
                r = self.reqs.get(rid)
                if r is not None:
                    r.mark_finish(FinishReason("abort", message))

    def settle(self) -> None:
        """Take in pending submissions and aborts and finish what they marked. Only between steps."""
        self._drain_inbox()
        self._finish_marked()

    def has_rid(self, rid: str) -> bool:
        return rid in self.reqs

    def check_new_rid(self, rid: str) -> None:
        if rid in self.reqs:
            raise ConflictError(
                f"a request with id {rid!r} is already running", param="rid", code="duplicate_rid"
            )

    # -- ledger view ----------------------------------------------------------------------------------
    def holdings(self) -> Iterable[Holding]:
        if self.sessions is not None:
            yield from self.sessions.holdings()
        for r in self.running:
            yield self.kv.holding(r)
        for r in self.waiting:
            if r.slot is not None:  # never true; listed so an audit would show it
                yield self.kv.holding(r)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting and self._inbox.empty()

    # -- the one release path -------------------------------------------------------------------------
    def _finish(self, req: Req) -> None:
        reason = req.to_finish
        assert reason is not None
        for hook in self.release_hooks:
            try:
                hook(req)
            except Exception:  # a faulty component must not stop the release
                log.exception("release hook %r failed for request %s", hook, req.rid)
        # KV from a failed forward is not trusted for reuse; everything else is valid and cached. A
        # session turn writes into its session only when it completed (never on abort).
        commit = reason.type != "abort" if req.session is not None else reason.status < 500
        self.kv.release(req, commit=commit)
        if req.state is ReqState.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state = ReqState.FINISHED
        if self.reqs.get(req.rid) is req:  # a duplicate must not unregister the original
            del self.reqs[req.rid]
        self._emit_final(req)

    def _emit_final(self, req: Req) -> None:
        req.finish_reason = req.to_finish
        req.state = ReqState.FINISHED
        self._outputs.append(
            StepOutput(
                rid=req.rid,
                new_ids=[],
                new_logprobs=[],
                new_top_logprobs=[],
                finished=True,
                finish_reason=req.finish_reason,
                prompt_tokens=len(req.input_ids),
                completion_tokens=len(req.output_ids),
                cached_tokens=req.cached_tokens,
            )
        )

    def _finish_marked(self) -> None:
        marked = [r for r in itertools.chain(self.running, self.waiting) if r.to_finish is not None]
        for r in marked:
            self._finish(r)

    def _retract(self, req: Req) -> None:
        """Give a running request's memory back and requeue it at the front; its output is kept and
        its KV recomputed (largely from the prefix cache) when it is admitted again."""
        # Normal requests leave their computed KV in the tree (cheap recompute); a session turn only
        # frees its own pages: its session must not change before the turn completes.
        self.kv.release(req, commit=req.session is None, final=False)
        self.running.remove(req)
        req.state = ReqState.WAITING
        req.num_retractions += 1
        self.waiting.appendleft(req)
        self.total_retractions += 1
        self.last_stats.num_retracted += 1
        log.info("retracted request %s (%d output tokens kept)", req.rid, len(req.output_ids))

    # -- batch building -------------------------------------------------------------------------------
    def _schedule_decodes(self, decodes: list[Req]) -> list[tuple[Req, int]]:
        scheduled: list[tuple[Req, int]] = []
        for req in sorted(decodes, key=lambda r: r.admitted_seq):
            if req.state is not ReqState.RUNNING:
                continue  # retracted below as a victim for an older request
            while not self.kv.reserve(req, 1):
                victims = [r for r in self.running if r is not req]
                if not victims:
                    self._mark_too_big(req)
                    break
                victim = max(victims, key=lambda r: r.admitted_seq)
                scheduled = [(r, n) for r, n in scheduled if r is not victim]
                self._retract(victim)
            else:
                scheduled.append((req, 1))
        return scheduled

    def _schedule_prefills(self, budget: int, reserve_pages: int) -> list[tuple[Req, int]]:
        out: list[tuple[Req, int]] = []
        for req in sorted(self.running, key=lambda r: r.admitted_seq):
            if budget <= 0:
                return out
            if req.kv_len < req.seq_len - 1 and req.to_finish is None:
                n = min(budget, req.seq_len - req.kv_len)
                if not self.kv.reserve(req, n):
                    return out
                out.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if req.to_finish is not None:
                return out
            if not self.kv.admit(req):
                return out
            n = min(budget, req.seq_len - req.kv_len)
            # Leave room for the running requests' next tokens, or admission would only cause retraction.
            if self.kv.available_pages() - self.kv.pages_needed(
                req, n
            ) < reserve_pages or not self.kv.reserve(req, n):
                self.kv.release(req, commit=False, final=False)
                return out
            self.waiting.popleft()
            req.state = ReqState.RUNNING
            req.admitted_seq = next(self._admit_counter)
            if req.num_retractions == 0:
                req.cached_tokens = req.kv_len
            self.running.append(req)
            out.append((req, n))
            budget -= n
        return out

    def _schedule(self) -> list[tuple[Req, int]]:
        batch = self._schedule_once()
        # Progress guarantee: running requests that all wait for pages (say, several long prompts
        # admitted chunk by chunk) would wait forever. Retract the newest until the oldest can move.
        while not batch and any(r.to_finish is None for r in self.running):
            live = [r for r in self.running if r.to_finish is None]
            if len(live) == 1:
                self._mark_too_big(live[0])
                break
            self._retract(max(live, key=lambda r: r.admitted_seq))
            batch = self._schedule_once()
        if not batch and not self.running and self.waiting and self.waiting[0].to_finish is None:
            # Nothing runs and the first waiting request still cannot be admitted: it never will be.
            self._mark_too_big(self.waiting[0])
        return batch

    def _mark_too_big(self, req: Req) -> None:
        """A request that cannot fit even alone (what is left after sessions' busy KV) ends cleanly."""
        total = self.kv.pages.num_pages * self.kv.page_size
        req.mark_finish(
            FinishReason(
                "abort",
                f"the KV cache ({total} tokens) cannot hold this request ({req.seq_len} tokens) next to what "
                f"running session turns hold; raise max_total_tokens",
                status=503,
            )
        )

    def _schedule_once(self) -> list[tuple[Req, int]]:
        decodes = [r for r in self.running if r.kv_len == r.seq_len - 1 and r.to_finish is None]
        budget = self.cfg.chunked_prefill_size
        if self.cfg.enable_mixed_chunk:
            batch = self._schedule_decodes(decodes) if decodes else []
            reserve = len(self.running)
            return batch + self._schedule_prefills(max(budget - len(batch), 1), reserve)
        # Unmixed: a prefill batch when there is prefill work that fits, else a decode batch.
        batch = self._schedule_prefills(budget, len(decodes))
        return batch or (self._schedule_decodes(decodes) if decodes else [])

    # -- results --------------------------------------------------------------------------------------
    def _check_stop(self, req: Req, tok: int) -> None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            req.mark_finish(FinishReason("stop", matched=tok))
        elif len(req.output_ids) >= p.max_new_tokens:
            req.mark_finish(FinishReason("length"))
        elif req.seq_len >= self.context_length:
            req.mark_finish(FinishReason("length", "reached the context length"))
        elif p.stop and self.decode is not None:
            # Decode a tail long enough to contain the longest stop string.
            tail = self.decode(req.output_ids[-(max(map(len, p.stop)) + 8) :])
            for s in p.stop:
                if s in tail:
                    req.mark_finish(FinishReason("stop", matched=s))
                    break

    def _process(self, work: list[tuple[Req, int]], sample_at: list[int], result) -> None:
        now = time.monotonic()
        for req, n in work:
            req.kv_len += n
        if result is None:
            return
        for k, j in enumerate(sample_at):
            req = work[j][0]
            tok = result.tokens[k]
            req.output_ids.append(tok)
            req.output_logprobs.append(result.logprobs[k])
            req.output_top_logprobs.append(result.top_logprobs[k])
            if req.first_token_time is None:
                req.first_token_time = now
            self._check_stop(req, tok)
            self._outputs.append(
                StepOutput(
                    rid=req.rid,
                    new_ids=[tok],
                    new_logprobs=[result.logprobs[k]],
                    new_top_logprobs=[result.top_logprobs[k]],
                    finished=False,
                    finish_reason=None,
                    prompt_tokens=len(req.input_ids),
                    completion_tokens=len(req.output_ids),
                    cached_tokens=req.cached_tokens,
                )
            )

    def _run_isolated(self, work: list[tuple[Req, int]]) -> None:
        """Contain a failed forward: rerun each request alone (the failed forward advanced nothing,
        and rewriting the same KV slots is harmless). Only the requests that fail alone end, with a
        500, through the release path; their neighbours go on as if nothing happened."""
        for item in work:
            try:
                sample_at, result = self.runner.run([item])
            except Exception as e:
                log.error("request %s failed: %s: %s", item[0].rid, type(e).__name__, e)
                item[0].mark_finish(
                    FinishReason(
                        "abort",
                        f"engine error while computing this request: {type(e).__name__}: {e}",
                        status=500,
                    )
                )
            else:
                self._process([item], sample_at, result)

    # -- the loop ---------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One iteration of the engine loop; returns what happened to requests in it."""
        self._drain_inbox()
        self._finish_marked()
        self.last_stats = StepStats()
        work = self._schedule()
        if work:
            self._was_busy = True
            try:
                sample_at, result = self.runner.run(work)
            except Exception:
                log.exception("a forward of %d requests failed; running them one by one", len(work))
                self._run_isolated(work)
            else:
                self._process(work, sample_at, result)
            self.last_stats.num_tokens = sum(n for _, n in work)
            self.last_stats.num_decode = sum(1 for r, n in work if n == 1)
            self.last_stats.num_prefill_tokens = sum(n for _, n in work if n > 1)
        self._finish_marked()
        ledger = self.kv.ledger
        if ledger.strict:
            ledger.check_conservation()
        if self.idle and self._was_busy:
            now = time.monotonic()
            if ledger.strict or now - self._last_audit >= self.cfg.audit_interval_s:
                self._was_busy = False
                self._last_audit = now
                ledger.audit()
        out, self._outputs = self._outputs, []
        return out
