"""Batch policy: which requests run in the next forward and how many tokens each brings.

Running decodes first (oldest first; when the pool cannot hold a request's next tokens, the newest
running request is *retracted*: its memory goes back through the release path and it requeues),
then prefill chunks of admitted requests and of newly admitted ones within ``chunked_prefill_size``.
Mixed mode puts both in one forward; unmixed, a prefill batch runs when there is prefill work that
fits, else a decode batch. With interleaving (``--interleave-prefill-tokens``, on by default on the
CPU), a step brings at most that many prompt tokens while requests decode, and unmixed a decode batch
follows each such prefill batch. With pacing (``--mixed-step-ratio``, on by default on the CPU) that
budget is what keeps the running streams' next token within R of their decode steps, by the costs
the engine measures (``pacing.py``). A progress guarantee retracts or ends requests that could never run.

The waiting queue is ordered first (``queue_order.py``). With priority scheduling, decodes run most
important first, the victim of a retraction is the least important (then the newest), and a waiting
request that does not fit (no slot, or not enough pages) *preempts*: running requests whose priority
is lower by more than the threshold are retracted for it, least important first, when together they
would make room (SGLang's rule, ``preemption.py``); retraction keeps their output, so it ends as it
would have. A decode's drafts (speculative decoding) are chosen in ``drafts.py``.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from ..common import FinishReason
from ..model.linear import amx_available
from .drafts import choose_drafts
from .overlap import ends_pending
from .pacing import StepCosts
from .preemption import preempt_for
from .queue_order import QueueOrder
from .request import Req, ReqState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    """``req`` computes its next ``num_tokens`` sequence tokens, then verifies ``drafts``."""

    req: Req
    num_tokens: int
    drafts: list[int] = field(default_factory=list)


class BatchPolicy:
    def __init__(self, sched):
        self.s = sched  # the Scheduler: its queues, KVManager, connector, proposer, config
        self._admit_counter = itertools.count(1)
        self.deferred: set[str] = set()  # waiting requests a connector asked to wait this step
        self.order = QueueOrder(sched.cfg.scheduler, sched.kv_manager.tree, sched.kv_manager.cache_key)
        self.priorities = sched.cfg.scheduler.enable_priority_scheduling
        self.total_preemptions = 0  # requests retracted for a more important one
        # --interleave-prefill-tokens (0: prefill first), and whether the last batch was a prefill's.
        self.interleave = sched.cfg.scheduler.interleave_tokens(sched.cfg.model.device, amx_available())
        self.prefilled_last = False
        # --mixed-step-ratio (0: off): steps while requests decode are mixed and paced by the measured
        # step costs, which the engine reports as it times each forward (``costs.observe``).
        self.step_ratio = sched.cfg.scheduler.step_ratio(sched.cfg.model.device) if self.interleave else 0.0
        self.costs = StepCosts()

    def _live(self, r: Req) -> bool:
        """Not ending: no cause marked, and (overlap) no token in flight that surely ends it."""
        return r.to_finish is None and not (self.s.overlap and ends_pending(r, self.s.context_length))

    @staticmethod
    def seniority(r: Req) -> tuple[int, int]:
        """Decodes and prefill chunks run in ascending order (the most important, then the oldest);
        retraction takes the max (the least important, then the newest). Without priority
        scheduling every rank is 0: admission order alone, as before priorities."""
        return r.priority_rank, r.admitted_seq

    # -- retraction --------------------------------------------------------------------------------
    def retract(self, req: Req) -> None:
        """Give a running request's memory back and requeue it at the front; its output is kept and
        its KV recomputed (largely from the prefix cache) when it is admitted again."""
        s = self.s
        # Normal requests leave their computed KV in the tree (cheap recompute); a session turn only
        # frees its own pages: its session must not change before the turn completes.
        s.kv_manager.release(req, commit=req.session is None, final=False)
        s.images.release(req)  # its image embeddings are encoded again when it is readmitted
        s.running.remove(req)
        req.state = ReqState.WAITING
        req.num_retractions += 1
        s.waiting.appendleft(req)
        s.total_retractions += 1
        s.last_stats.num_retracted += 1
        log.info("retracted request %s (%d output tokens kept)", req.rid, len(req.output_ids))

    def pages_coming_back(self) -> bool:
        """A connector holds pages it will give back: KV arriving (its request then runs, and can be
        retracted) or being sent (freed on the ack or at the timeout). Until then no request is too
        big: it waits."""
        # (overlap) A launched step's result may end requests: in a synchronous step their pages
        # would be back already, so nothing is too big before it is in.
        return bool(self.s.waiting_for_kv or self.s.sending or len(self.s.in_flight))

    def mark_too_big(self, req: Req) -> None:
        """A request that cannot fit even alone (what is left after sessions' busy KV) ends cleanly."""
        total = self.s.kv_manager.pages.num_pages * self.s.kv_manager.page_size
        req.mark_finish(
            FinishReason(
                "abort",
                f"the KV cache ({total} tokens) cannot hold this request ({req.seq_len} tokens) next to what "
                f"running session turns hold; raise max_total_tokens",
                status=503,
            )
        )

    # -- decodes ------------------------------------------------------------------------------------
    def schedule_decodes(self, decodes: list[Req]) -> list[Chunk]:
        s = self.s
        scheduled: list[Chunk] = []
        # Drafts share the step's token budget: verifying never makes a step bigger than a prefill one.
        budget = s.cfg.scheduler.chunked_prefill_size - len(decodes)
        for req in sorted(decodes, key=self.seniority):
            if req.state is not ReqState.RUNNING:
                continue  # retracted below as a victim for an older request
            if req.sparse is not None and s.kv_manager.sparse.ready(req):
                s.kv_manager.sparse.begin(req)  # its first decode: sparse from here on
            drafts = choose_drafts(req, budget, s.proposer, s.kv_manager, s.context_length)
            budget -= len(drafts)
            while not s.kv_manager.allocate(req, 1, num_lookahead_tokens=len(drafts)):
                if drafts:
                    drafts = []  # no room to speculate: decode plainly
                    continue
                victims = [r for r in s.running if r is not req]
                if not victims:
                    if not self.pages_coming_back():
                        self.mark_too_big(req)
                    break
                victim = max(victims, key=self.seniority)
                scheduled = [c for c in scheduled if c.req is not victim]
                self.retract(victim)
            else:
                scheduled.append(Chunk(req, 1, drafts))
        return scheduled

    # -- prefills -----------------------------------------------------------------------------------
    def _admit(self, req: Req, budget: int, reserve_pages: int) -> Chunk | None:
        """Admit a waiting request: slot, cached prefix, external KV, pages for its chunk. A request
        the connector is still fetching KV for, or that it holds back, is deferred (``self.deferred``;
        nothing held)."""
        s = self.s
        if not s.connector.may_admit(req):
            self.deferred.add(req.rid)
            return None
        if not s.kv_manager.admit(req):
            return None
        if s.kv_manager.sparse is not None and not s.kv_manager.sparse.reserve(req):
            s.kv_manager.release(req, commit=False, final=False)
            return None
        ext, load_async = s.connector.get_num_new_matched_tokens(req, req.kv_len)
        if ext is None:
            s.kv_manager.release(req, commit=False, final=False)
            self.deferred.add(req.rid)
            return None
        # Loaded KV leaves the last prompt token to compute, unless it arrives async with the remote
        # side's first output token (PD decode: ``Scheduler._join_received``).
        ext = min(ext, req.seq_len - req.kv_len - (0 if load_async else 1))
        n = min(budget, req.seq_len - req.kv_len - ext)
        # HiSparse on a PD decode server: the KV prefill sends lands in the request's host pages.
        to_host = bool(ext and load_async and req.sparse is not None and getattr(s.connector, "lands_in_host", False))
        ext_pages = 0 if to_host else ext
        # Leave room for the running requests' next tokens, or admission would only cause retraction.
        fits = s.kv_manager.available_pages() - s.kv_manager.pages_needed(req, n + ext_pages) >= reserve_pages
        if not fits or not s.kv_manager.allocate(req, ext_pages + (0 if load_async else n)):
            s.kv_manager.release(req, commit=False, final=False)
            return None
        s.waiting.remove(req)
        req.admitted_seq = next(self._admit_counter)
        if req.num_retractions == 0:
            # Transferred KV is not a cache hit (PD decode): the remote side's own hit is added when
            # its KV arrives (``Scheduler._join_received``).
            req.cached_tokens = req.kv_len + s.connector.cached_external_tokens(req, ext)
        if ext:
            pages = s.kv_manager.sparse.land(req) if to_host else req.pages
            s.connector.update_state_after_alloc(req, pages[req.kv_len // s.kv_manager.page_size :], ext)
        if ext and load_async:
            req.num_external_tokens = ext
            req.state = ReqState.WAITING_FOR_KV  # joins running when the connector reports the load
            s.waiting_for_kv.append(req)
            return Chunk(req, 0)
        req.kv_len += ext  # loaded by the worker side before this step's forward
        req.state = ReqState.RUNNING
        s.running.append(req)
        return Chunk(req, n)

    def schedule_prefills(self, budget: int, reserve_pages: int) -> list[Chunk]:
        s = self.s
        out: list[Chunk] = []
        for req in sorted(s.running, key=self.seniority):
            if budget <= 0:
                return out
            if req.kv_len < req.seq_len - 1 and req.to_finish is None:
                n = min(budget, req.seq_len - req.kv_len)
                if not s.kv_manager.allocate(req, n):
                    return out
                out.append(Chunk(req, n))
                budget -= n
        for req in list(s.waiting):
            if budget <= 0 or req.to_finish is not None:
                return out
            if not self._adapter_fits(req):
                self.deferred.add(req.rid)  # its adapter waits for one of the running ones to end
                continue
            if self._slots_full() and not preempt_for(self, req, budget, reserve_pages, slot=True):
                return out
            chunk = self._admit(req, budget, reserve_pages)
            if chunk is None and req.rid not in self.deferred and preempt_for(self, req, budget, reserve_pages):
                chunk = self._admit(req, budget, reserve_pages)
            if chunk is None:
                if req.rid in self.deferred:
                    continue  # its KV is still being fetched: the next one may go first
                return out
            if chunk.num_tokens:
                out.append(chunk)
                budget -= chunk.num_tokens
        return out

    def _adapter_fits(self, req: Req) -> bool:
        """``--max-loras-per-batch``: a request of an adapter no running request uses is admitted only
        while fewer than that many adapters run (the base model counts as none), so no step's batch
        has more. Others go first meanwhile (it is deferred, not blocking the queue)."""
        name = req.params.lora_path
        if name is None:
            return True
        s = self.s
        running = {r.params.lora_path for r in (*s.running, *s.waiting_for_kv)} - {None}
        return name in running or len(running) < s.cfg.lora.max_loras_per_batch

    def _slots_full(self) -> bool:
        s = self.s
        return len(s.running) + len(s.waiting_for_kv) >= s.cfg.scheduler.max_running_requests

    # -- the batch ----------------------------------------------------------------------------------
    def _schedule_once(self) -> list[Chunk]:
        s = self.s
        decodes = [r for r in s.running if r.kv_len == r.seq_len - 1 and self._live(r)]
        budget = s.cfg.scheduler.chunked_prefill_size
        if decodes and self.interleave:
            budget = min(budget, self.interleave)
        # Pacing (--mixed-step-ratio): the prompt tokens that keep the running streams' next token
        # within the ratio of their decode step, by the measured costs (pacing.py).
        paced = bool(decodes and self.step_ratio)
        forming = min(len(s.running) + len(s.waiting), s.cfg.scheduler.max_running_requests)
        if s.cfg.scheduler.enable_mixed_chunk:
            batch = self.schedule_decodes(decodes) if decodes else []
            budget = max(budget - len(batch), 1)
            if paced:
                rows = sum(1 + len(c.drafts) for c in batch)
                budget = self.costs.mixed_budget(rows, forming, self.step_ratio, budget)
            batch += self.schedule_prefills(budget, len(s.running))
            return [c for c in batch if c.req.state is not ReqState.WAITING]  # preempted meanwhile
        if decodes and self.interleave and self.prefilled_last:
            # Interleaving: the running streams advance between two prefill steps.
            batch = self.schedule_decodes(decodes)
            if batch:
                self.prefilled_last = False
                return batch
        if paced:
            budget = self.costs.prefill_budget(len(decodes), forming, self.step_ratio, budget)
        batch = self.schedule_prefills(budget, len(decodes))
        batch = [c for c in batch if c.req.state is not ReqState.WAITING]  # preempted meanwhile
        self.prefilled_last = bool(batch)
        return batch or (self.schedule_decodes(decodes) if decodes else [])

    def schedule(self) -> list[Chunk]:
        s = self.s
        self.deferred.clear()
        self.order.sort(s.waiting)
        batch = self._schedule_once()
        # Progress guarantee: running requests that all wait for pages (say, several long prompts
        # admitted chunk by chunk) would wait forever. Retract the newest until the oldest can move.
        while not batch and any(self._live(r) for r in s.running):
            live = [r for r in s.running if self._live(r)]
            if len(live) == 1:
                if not self.pages_coming_back():
                    self.mark_too_big(live[0])
                break
            self.retract(max(live, key=self.seniority))
            batch = self._schedule_once()
        if (
            not batch
            and not s.running
            and not self.pages_coming_back()
            and s.waiting
            and s.waiting[0].to_finish is None
            and s.waiting[0].rid not in self.deferred
        ):
            # Nothing runs, no connector holds pages it will give back, and the first waiting
            # request still cannot be admitted: it never will be.
            self.mark_too_big(s.waiting[0])
        return batch
