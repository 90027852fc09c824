"""The prefill side: wait for the decode server to claim the room, run the prompt, hand its KV and
first token to the claimant, free the pages when decode acknowledges.

A request is admitted only once its room is claimed (until then ``may_admit``
defers it: it waits in the queue holding nothing), as SGLang's prefill bootstrap queue waits for the
decode side's handshake. A claim means decode has already reserved the pages the KV goes to, so KV
held here is taken at once. Computing unclaimed requests deadlocked small pools: prefill's pages
held the KV of a request decode could not admit yet (its pool busy with a request waiting for KV),
while that request's own prefill waited for those pages, until the 60 s timeouts (combination fuzz).
A request whose room is not claimed within the bootstrap timeout, or whose decode side gave up, is
aborted (502).

Ledger: a finished request whose KV waits to be sent keeps its slot and pages in the state
``req X [kv sending]`` (``request_finished`` returns True); it is released through the one release
path when ``get_finished`` reports it (acknowledged, the decode side gave up, or the bootstrap
timeout passed). Its KV is then committed to the prefix cache like any finished request's.

A session turn (``session_params``: the session is the decode server's) is a plain request here
whose prompt is the one decode's claim carries -- the session's history + the input this side was
sent -- taken before admission (``_take_prompt``); prefill computes all of it and sends what decode's
session lacks. Prefill never holds a session.

Under tensor parallelism (``tp.py``) the KV of a finished request is first collected from every rank
(in the next step: ``build_connector_meta`` names its locations, ``start_load_kv`` joins the heads on
rank 0) and sent from that block; until then a claim waits as before the request finished.

The bootstrap endpoint, what it trusts and what the I/O thread does with its messages are in
``prefill_bootstrap.py``; the rooms' books, which both threads keep, in ``prefill_rooms.py``.
"""

from __future__ import annotations

import logging
import time

from ..connector import KVConnector
from ..errors import ConflictError
from ..memory.pools import KVBuffer
from . import kv_copy, wire
from .prefill_bootstrap import AbortFn, PrefillBootstrap
from .prefill_rooms import SendJob, why_ended
from .tp import PDMeta, RankHeads

log = logging.getLogger("kvledger.disagg")


class PrefillConnector(PrefillBootstrap, KVConnector):
    """The engine thread's side (the scheduler's hooks) and rank 0's worker side of the prefill
    connector; its bootstrap endpoint's I/O thread is ``PrefillBootstrap``."""

    def __init__(
        self,
        kv: KVBuffer,
        page_size: int,
        bind_host: str,
        port: int,
        timeout_s: float,
        abort: AbortFn | None = None,
        data=None,
        limits=None,
        heads: RankHeads | None = None,
        kv_heads: int | None = None,
        key: bytes | None = None,
        max_claims_per_peer: int = 512,
    ):
        """``key``: the PD nodes' shared key (``auth.py``; None: unauthenticated, loopback only);
        ``max_claims_per_peer``: rooms one connection may hold claimed and not acknowledged."""
        super().__init__(kv, page_size, timeout_s, abort, data, limits, kv_heads, key, max_claims_per_peer)
        self.heads = heads  # tensor parallel: rank 0's part of collecting every rank's heads (tp.py)
        self._to_collect: list[SendJob] = []  # finished, their heads not collected yet (engine thread)
        self._collecting: list[SendJob] = []  # ... named in the step being run
        self._meta_at = 0.0  # when that step's meta was built (TransferStats.tp_copy_seconds)
        self._listen(bind_host, port)

    # -- scheduler side (engine thread) -----------------------------------------------------------------
    def check_request(self, req) -> None:
        d = req.disagg
        if d is None or d.fake:
            return
        with self._lock:
            if d.room in self._live or d.room in self._jobs:
                raise ConflictError(f"bootstrap_room {d.room} is already in use", param="bootstrap_room")
            self._live[d.room] = req.rid
            self._arrived[d.room] = time.monotonic()
            self._ended.pop(d.room, None)  # the room is live again

    def may_admit(self, req) -> bool:
        """A request whose room decode has not claimed yet is not admitted: it waits, holding nothing
        (see the module docstring)."""
        d = req.disagg
        if d is None or d.fake:
            return True
        why = None  # a session turn's claim refused: the request ends (502)
        first = False  # ... noticed for the first time (abort once)
        gone = None  # decode gave up before this request arrived (its reason): it will never claim
        with self._lock:
            pending = self._claims.get(d.room)
            if pending is not None and req.prompt_from_claim:
                why = self._take_prompt(req, pending.claim)
                if why is None:
                    return True
                first = d.room not in self._aborting
                self._aborting.add(d.room)
            elif pending is not None or d.room in self._jobs:
                return True
            else:
                if d.room in self._gone and d.room not in self._aborting:
                    gone = self._gone[d.room][1]
                    self._aborting.add(d.room)
        if first:
            # The claim stays: the request's end answers it with a Fail naming this reason.
            self.stats.frames_refused += 1
            log.warning("PD prefill: refused the claim for room %d: %s", d.room, why)
            self.abort(req.rid, f"refused the decode server's claim: {why}", 502, "kv_transfer_refused")
        elif gone is not None:
            self.abort(req.rid, f"the decode server gave up this bootstrap room: {gone}", 502, "kv_transfer_failed")
        return False

    def _take_prompt(self, req, claim: wire.Claim) -> str | None:
        """A session turn (the session lives on decode): its prompt is the one the claim carries, the
        session's history + this request's input. Checked as a peer's input (its length and crc, the
        vocabulary, the context, and that it ends with the input this request was sent), then it
        replaces the request's prompt before anything is held. Returns why it is refused, or None."""
        ids = claim.tokens
        if ids is None:
            return "a session turn's claim must carry its prompt (a decode server of an older version?)"
        if len(ids) != claim.num_tokens or wire.prompt_crc(req, ids) != claim.tokens_crc:
            return "the claim's prompt does not match its length and checksum"
        lim = self.limits
        if lim is not None:
            if len(ids) >= lim.context_length:
                return f"the claim's prompt of {len(ids)} tokens does not fit the context ({lim.context_length})"
            if any(type(t) is not int or not 0 <= t < lim.vocab_size for t in ids):
                return "the claim's prompt has token ids outside the vocabulary"
        n = len(req.input_ids)
        if n > len(ids) or ids[len(ids) - n :] != req.input_ids:
            return "the claim's prompt does not end with this request's input"
        req.input_ids = list(ids)
        req.prompt_from_claim = False  # taken: a retracted request is admitted again as it is now
        return None

    def request_refused(self, req, why: str) -> None:
        d = req.disagg
        if d is None or d.fake:
            return
        # Refused before it was queued: a claim for its room (now or later) is answered at once.
        self.io.post(("finished", d.room, f"the prefill server refused the request: {why}"))

    def request_finished(self, req) -> bool:
        d = req.disagg
        if d is None or d.fake:
            return False
        reason = req.to_finish
        ok = (
            reason is not None
            and reason.type != "abort"
            and req.slot is not None
            and req.output_ids
            and req.kv_len >= len(req.input_ids)
        )
        with self._lock:
            self._live.pop(d.room, None)
            self._arrived.pop(d.room, None)
            self._aborting.discard(d.room)
            if self._gone.pop(d.room, None) is not None:
                ok = False  # decode already gave up: nothing to keep
            if ok:
                top = req.output_top_logprobs[0] if req.output_top_logprobs else None
                first = wire.Done(
                    d.room,
                    len(req.input_ids),
                    req.output_ids[0],
                    req.output_logprobs[0],
                    top,
                    cached_tokens=req.cached_tokens,
                )
                crc = wire.prompt_crc(req)
                job = SendJob(req.rid, d.room, list(req.pages), len(req.input_ids), crc, first)
                self._jobs[d.room] = job
                claim = self._claims.get(d.room)
                job.staged_start = claim.claim.start if claim is not None else 0
                if self.heads is not None and job.staged_start < job.num_tokens:
                    job.collected = False  # the next step collects its heads; then it is sent
                    self._to_collect.append(job)
                    return True
        self.io.post(("finished", d.room, None if ok else why_ended(reason)))
        return bool(ok)

    def build_connector_meta(self, sched_out) -> PDMeta | None:
        """Tensor parallel: the locations of the finished requests whose heads this step collects."""
        if self.heads is None:
            return None
        with self._lock:
            jobs = [j for j in self._to_collect if self._jobs.get(j.room) is j]
            self._to_collect = []
        self._collecting = jobs
        if not jobs:
            return None
        self._meta_at = time.perf_counter()
        locs = [kv_copy.locations(j.pages, self.page_size, j.staged_start, j.num_tokens) for j in jobs]
        return PDMeta(self.layout.kv_heads, collect=locs)

    @property
    def has_pending(self) -> bool:
        return bool(self._to_collect or self._collecting)

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            done, self._done = self._done, set()
        return done, set()

    def close(self) -> None:
        self.io.close()

    # -- rank 0's worker side (tensor parallel) ---------------------------------------------------------
    def start_load_kv(self, meta: PDMeta | None, kv_buffer) -> None:
        if self.heads is None:
            return
        blocks = self.heads.apply(meta, kv_buffer)
        jobs, self._collecting = self._collecting, []
        if jobs:
            self.stats.tp_copy_seconds += time.perf_counter() - self._meta_at
        with self._lock:
            for job, blk in zip(jobs, blocks, strict=True):
                if self._jobs.get(job.room) is not job:
                    continue  # released meanwhile (timed out, decode gave up): nothing to send
                job.staged, job.collected = blk, True
                self.stats.stage(blk.nbytes)
        for job in jobs:
            self.io.post(("finished", job.room, None))
