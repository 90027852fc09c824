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

The bootstrap endpoint is a ZMQ ROUTER bound at ``--disaggregation-bind-host`` (loopback by default) :
``--disaggregation-bootstrap-port``; decode servers connect to it (see ``wire.py``). What it trusts:
a message is applied only if its seal opens under the PD nodes' key (``auth.py``: not forged, not
replayed); anything else is counted (``frames_refused``), logged at most once a second and never
answered. A room is the claimant's once claimed: another peer's claim, acknowledgement or failure for
it is refused, and its KV is sent once (a second claim cannot restart the timeout or the transfer).
One peer (connection) holds at most ``--disaggregation-max-claims-per-peer`` rooms claimed and not
acknowledged, and a claim's prompt is bounded by the context, so what a peer makes this server hold is
bounded; whatever it holds is released at the bootstrap timeout through the one release path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from ..connector import KVConnector
from ..errors import ConflictError, ValidationError
from ..memory.pools import KVBuffer
from . import kv_copy, wire
from .auth import TO_DECODE, TO_PREFILL, Opener, Sealers
from .endpoint import CHUNK_TOKENS, Endpoint, RefusalLog, TransferStats, peer_address, tcp_endpoint
from .tp import PDMeta, RankHeads

log = logging.getLogger("kvledger.disagg")
CLAIM_BACKSTOP = 2.0  # a claim whose prefill request never comes is dropped after this x the timeout
MAX_GONE = 65536  # rooms remembered as given up before their request came (the oldest forgotten first)
MAX_REASON_CHARS = 512  # of a peer's reason, kept and shown
# The bootstrap port takes messages of at most this many bytes per frame; a larger frame drops its
# connection inside ZMQ before it is buffered. Frames between the header limit and this are refused
# and counted here.
MAX_FRAME_BYTES = 2 * wire.MAX_HEADER_BYTES

# abort(rid, message, status, code): ends a request at the next safe point (thread-safe)
AbortFn = Callable[[str, str, int, str], None]


@dataclass
class _SendJob:
    rid: str
    room: int
    pages: list[int]
    num_tokens: int
    crc: int
    first: wire.Done
    created: float = field(default_factory=time.monotonic)
    peer: bytes | None = None  # the claimant's ZMQ identity, once it claimed
    start: int = 0
    sent_at: float | None = None
    direct: bool = False  # the claimant asked for Mooncake writes
    # Tensor parallel: every head of positions staged_start..num_tokens, joined on rank 0 (tp.py);
    # sent from here instead of the pages. ``collected`` is False until the step that joins them ran.
    staged: torch.Tensor | None = None
    staged_start: int = 0
    collected: bool = True


@dataclass
class _Claim:
    peer: bytes
    claim: wire.Claim
    at: float = field(default_factory=time.monotonic)


class PrefillConnector(KVConnector):
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
        self.kv, self.page_size, self.timeout_s = kv, page_size, timeout_s
        self.opener = Opener(key, TO_PREFILL)  # what decode servers send here
        self.sealers = Sealers(key, TO_DECODE)  # one sending session per decode connection
        self.max_claims_per_peer = max_claims_per_peer
        self._refused_log = RefusalLog("prefill")
        self.limits = limits  # the engine's Limits: a prompt a claim carries is checked against them
        self.abort = abort or (lambda *a: None)
        self.data = data  # a MooncakeData (mooncake.py), or None: KV goes as KVData frames
        self.heads = heads  # tensor parallel: rank 0's part of collecting every rank's heads (tp.py)
        self.layout = kv_copy.layout_of(kv, kv_heads)
        self._to_collect: list[_SendJob] = []  # finished, their heads not collected yet (engine thread)
        self._collecting: list[_SendJob] = []  # ... named in the step being run
        self._meta_at = 0.0  # when that step's meta was built (TransferStats.tp_copy_seconds)
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._live: dict[int, str] = {}  # room -> rid of a request not finished yet
        self._arrived: dict[int, float] = {}  # room -> when its live request came (the claim timeout)
        self._aborting: set[int] = set()  # live rooms whose request this side already asked to abort
        self._jobs: dict[int, _SendJob] = {}  # room -> finished, KV held
        self._claims: dict[int, _Claim] = {}  # room -> claimed before its request finished
        # Rooms the decode side gave up on before their request finished here (or arrived): kept for
        # one timeout, so the request does not hold its KV for nobody.
        self._gone: dict[int, tuple[float, str]] = {}  # room -> (when, decode's reason)
        # Rooms whose request ended here without KV to send before any claim came (aborted, timed
        # out): a late claim is answered at once with why, instead of waiting out its timeout.
        self._ended: dict[int, tuple[str, float]] = {}
        self._done: set[str] = set()
        self.io = Endpoint("kvledger-pd-prefill")
        self.sock = self.io.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.IPV6, ":" in bind_host)
        try:
            self.sock.bind(tcp_endpoint(bind_host, port))
        except zmq.ZMQError as e:
            self.sock.close()
            raise ValidationError(
                f"cannot bind the disaggregation bootstrap port {bind_host}:{port}: {e}",
                param="disaggregation_bootstrap_port",
            ) from None
        self.address = f"{bind_host}:{port}"
        self.io.watch(self.sock, "decode")
        self.io.on_frames, self.io.on_post, self.io.on_tick = self._on_frames, self._on_post, self._on_tick
        self.io.start()
        log.info("PD prefill: bootstrap endpoint on tcp://%s", self.address)

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
        if len(ids) != claim.num_tokens or wire.tokens_crc(ids, req.lora_key) != claim.tokens_crc:
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
                crc = wire.tokens_crc(req.input_ids, req.lora_key)
                job = _SendJob(req.rid, d.room, list(req.pages), len(req.input_ids), crc, first)
                self._jobs[d.room] = job
                claim = self._claims.get(d.room)
                job.staged_start = claim.claim.start if claim is not None else 0
                if self.heads is not None and job.staged_start < job.num_tokens:
                    job.collected = False  # the next step collects its heads; then it is sent
                    self._to_collect.append(job)
                    return True
        self.io.post(("finished", d.room, None if ok else _why(reason)))
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

    # -- the I/O thread ---------------------------------------------------------------------------------
    def _send(self, peer: bytes, msg, payload=None) -> None:
        frames = [peer, *wire.pack(msg, self.sealers(peer), payload)]
        self.sock.send_multipart(frames, copy=payload is None)

    def _refuse(self, why: str, *args) -> None:
        """Count a refused message and say why (at most once a second); it is never answered."""
        self.stats.frames_refused += 1
        self._refused_log(why, *args)

    def _job_done(self, job: _SendJob, outcome: str) -> None:
        """Report the job's rid through get_finished, so the scheduler releases its pages through the
        one release path (caller holds the lock and removed the job); count the outcome."""
        self._done.add(job.rid)
        self._unstage(job)
        st = self.stats
        if outcome == "ok":
            st.transfers_ok += 1
            st.tokens += job.num_tokens - job.start
            st.bytes += (job.num_tokens - job.start) * self.layout.bytes_per_token
            st.seconds += time.monotonic() - job.created
        elif outcome == "timeout":
            st.transfers_timed_out += 1
        else:
            st.transfers_failed += 1

    def _unstage(self, job: _SendJob) -> None:
        """Drop the job's collected block (caller holds the lock)."""
        if job.staged is not None:
            self.stats.stage(-job.staged.nbytes)
            job.staged = None

    def _on_frames(self, sock, _peer, frames) -> None:
        peer = bytes(frames[0])
        try:
            msg, _ = wire.unpack(frames[1:], self.opener)
        except wire.WireError as e:
            return self._refuse("refused a message from %s: %s", peer_address(frames[-1]), e)
        if isinstance(msg, wire.Claim):
            self._on_claim(peer, msg)
        elif isinstance(msg, wire.Ack):
            with self._lock:
                job = self._jobs.get(msg.room)
                if job is None or job.peer != peer or job.sent_at is None:
                    return self._refuse("refused an ack for room %d (not sent to that peer)", msg.room)
                del self._jobs[msg.room]
                self._job_done(job, "ok")
        elif isinstance(msg, wire.Fail):
            reason = msg.reason[:MAX_REASON_CHARS]
            with self._lock:
                job = self._jobs.get(msg.room)
                claimant = self._claimant(msg.room)
                if claimant not in (None, peer):
                    # Only the room's claimant may give it up (a room is not another peer's to end).
                    return self._refuse("refused a failure for room %d from a peer that did not claim it",
                                        msg.room)  # fmt: skip
                pending = self._claims.pop(msg.room, None)
                direct = (job is not None and job.direct) or (
                    pending is not None and pending.claim.mooncake is not None
                )
                if job is not None and job.peer in (None, peer):
                    del self._jobs[msg.room]
                    self._job_done(job, "failed")
                else:  # not finished yet, or not even arrived (the router posts to both at once)
                    self._gone[msg.room] = (time.monotonic(), reason)
                    while len(self._gone) > MAX_GONE:
                        del self._gone[next(iter(self._gone))]
                    rid = self._live.get(msg.room)
                    if rid is not None and msg.room not in self._aborting:
                        # Waiting for the claim (or computing for nobody): end it now.
                        self._aborting.add(msg.room)
                        why = f"the decode server gave up this room: {reason}"
                        self.abort(rid, why, 502, "kv_transfer_failed")
                if direct:  # a Mooncake claimant holds its pages until told no write will come
                    self._send(peer, wire.Fail(msg.room, "stopped: no more writes for this room"))
            log.info("PD prefill: decode gave up room %d: %s", msg.room, reason)
        else:
            self._refuse("refused a %s message (not for a prefill side)", type(msg).__name__)

    def _claimant(self, room: int) -> bytes | None:
        """The peer that claimed ``room`` (caller holds the lock), or None."""
        job = self._jobs.get(room)
        if job is not None and job.peer is not None:
            return job.peer
        pending = self._claims.get(room)
        return pending.peer if pending is not None else None

    def _open_rooms(self, peer: bytes) -> int:
        """Rooms ``peer`` has claimed and not acknowledged (caller holds the lock)."""
        claimed = sum(c.peer == peer for c in self._claims.values())
        return claimed + sum(j.peer == peer for j in self._jobs.values())

    def _claim_refusal(self, peer: bytes, claim: wire.Claim) -> str | None:
        """Why a claim is refused before it is kept (caller holds the lock), or None."""
        lim = self.limits
        n = claim.num_tokens if claim.tokens is None else max(claim.num_tokens, len(claim.tokens))
        if lim is not None and n >= lim.context_length:
            return f"a prompt of {n} tokens does not fit the context ({lim.context_length})"
        if self._claimant(claim.room) == peer:
            return None  # the same claim again: it takes nothing more
        if self._open_rooms(peer) >= self.max_claims_per_peer:
            return (
                f"this decode server holds {self.max_claims_per_peer} claimed rooms not acknowledged "
                "(--disaggregation-max-claims-per-peer)"
            )
        return None

    def _on_claim(self, peer: bytes, claim: wire.Claim) -> None:
        with self._lock:
            job = self._jobs.get(claim.room)
            ended = self._ended.pop(claim.room, None) if job is None else None
            if ended is not None:
                self._send(peer, wire.Fail(claim.room, ended[0]))
                return
            if job is not None and job.sent_at is not None and job.peer == peer:
                # Sent already: a claim again neither restarts the timeout nor sends the KV twice.
                return self._refuse("refused a second claim for room %d (its KV was sent)", claim.room)
            why = self._claim_refusal(peer, claim)
            if why is not None:
                self._refuse("refused a claim for room %d: %s", claim.room, why)
                self._send(peer, wire.Fail(claim.room, why))
                return
            if job is None or not job.collected:  # not finished, or its heads not collected yet
                prev = self._claims.get(claim.room)
                if prev is not None and prev.peer != peer:
                    self.stats.frames_refused += 1
                    self._send(peer, wire.Fail(claim.room, "the room is claimed by another decode server"))
                    return
                # The same peer claiming again replaces its claim but keeps when it first came (the backstop).
                at = prev.at if prev is not None else time.monotonic()
                self._claims[claim.room] = _Claim(peer, claim, at)
                return
            self._start(job, peer, claim)

    def _refusal(self, job: _SendJob, peer: bytes, claim: wire.Claim) -> str | None:
        if job.peer not in (None, peer):
            return "the room is claimed by another decode server"
        if claim.layout != self.layout:
            return f"KV layout differs: prefill {self.layout}, decode {claim.layout}"
        if claim.num_tokens != job.num_tokens or claim.tokens_crc != job.crc:
            return "the prompt differs from the one prefilled for this room"
        if not 0 <= claim.start <= claim.num_tokens:
            return f"start {claim.start} outside the prompt of {claim.num_tokens} tokens"
        if job.staged is not None and claim.start < job.staged_start:
            return f"start {claim.start} before the KV collected for this room (from {job.staged_start})"
        t = claim.mooncake
        if t is not None and self.data is not None:
            want = -(-claim.num_tokens // t.page_size) - claim.start // t.page_size if t.page_size > 0 else -1
            if t.page_size < 1 or len(t.pages) != want:
                return f"the claim names {len(t.pages)} pages for tokens {claim.start}..{claim.num_tokens}"
            if any(not 0 <= p < t.num_locations // t.page_size for p in t.pages):
                return "the claim names pages outside its pool"
        return None

    def _start(self, job: _SendJob, peer: bytes, claim: wire.Claim) -> None:
        """Send the room's KV (caller holds the lock). A refused claim is counted and answered; the
        job waits on for the right claimant (or its timeout)."""
        why = self._refusal(job, peer, claim)
        if why is not None:
            self._refuse("refused a claim for room %d: %s", claim.room, why)
            self._send(peer, wire.Fail(claim.room, why))
            return
        job.peer, job.start = peer, claim.start
        if claim.mooncake is not None and self.data is not None:
            job.direct = True
            if claim.start < job.num_tokens:
                locs = kv_copy.locations(job.pages, self.page_size, claim.start, job.num_tokens)
                rc = self.data.write(locs, claim.mooncake, claim.start, self.layout)
                if rc != 0:
                    log.warning("PD prefill: mooncake write for room %d failed (%d)", job.room, rc)
                    del self._jobs[job.room]
                    self._job_done(job, "failed")
                    self._send(peer, wire.Fail(job.room, f"the mooncake write failed ({rc})"))
                    return
            self._send(peer, msgspec.structs.replace(job.first, direct=True))
            job.sent_at = time.monotonic()
            return
        for a in range(claim.start, job.num_tokens, CHUNK_TOKENS):
            b = min(a + CHUNK_TOKENS, job.num_tokens)
            if job.staged is not None:  # tensor parallel: every rank's heads, collected
                s = job.staged_start
                payload = kv_copy.to_bytes(job.staged[:, :, :, a - s : b - s]).numpy()
            else:
                payload = kv_copy.gather(self.kv, kv_copy.locations(job.pages, self.page_size, a, b)).numpy()
            self._send(peer, wire.KVData(job.room, a, b - a), payload)
            self.stats.kv_frames += 1
        self._unstage(job)  # a frame being sent keeps its bytes alive itself
        self._send(peer, job.first)
        job.sent_at = time.monotonic()

    def _on_post(self, item) -> None:
        _, room, why = item
        with self._lock:
            job = self._jobs.get(room)
            pending = self._claims.pop(room, None)
            if pending is None:
                if job is None:  # ended without KV before any claim: answer the claim when it comes
                    self._ended[room] = (why or "the prefill request ended", time.monotonic())
                return
            if job is not None:
                self._start(job, pending.peer, pending.claim)
            else:  # the request ended without KV to send: tell the claimant at once
                self._send(pending.peer, wire.Fail(room, why or "the prefill request ended"))

    def _on_tick(self, now: float) -> None:
        t = self.timeout_s
        with self._lock:
            for room, job in list(self._jobs.items()):
                if now - (job.sent_at or job.created) > t:
                    del self._jobs[room]
                    self._job_done(job, "timeout")
                    what = "an acknowledgement" if job.sent_at else "a decode server to claim it"
                    log.warning("PD prefill: room %d waited %.0fs for %s: released", room, t, what)
                    if job.peer is not None:
                        self._send(job.peer, wire.Fail(room, "prefill timed out"))
                    else:
                        self._ended[room] = ("the prefill request ended (its KV waited too long for a claim)", now)
            for room, c in list(self._claims.items()):
                # The decode side owns this wait: it times out at its own deadline, counts it and
                # tells us. This is only the backstop for a claimant that went away, so it waits
                # longer: with equal timeouts the two timers otherwise race (CI saw ours win).
                if now - c.at > CLAIM_BACKSTOP * t:
                    del self._claims[room]
                    why = f"no prefill request for this room in {CLAIM_BACKSTOP * t:.0f}s"
                    self._send(c.peer, wire.Fail(room, why))
            for room, rid in list(self._live.items()):
                # No decode server claimed the room in time (checked while the request waits; once
                # claimed it is computing, and the claim stays until it finished).
                if room in self._claims or room in self._aborting or now - self._arrived[room] <= t:
                    continue
                self._aborting.add(room)
                self.stats.transfers_timed_out += 1
                log.warning("PD prefill: room %d: no decode server claimed it in %.0fs", room, t)
                msg = f"no decode server claimed bootstrap room {room} in {t:.0f}s"
                self.abort(rid, msg, 502, "kv_transfer_timeout")
            for room, (at, _) in list(self._gone.items()):
                if now - at > t:
                    del self._gone[room]
            for room, (_, at) in list(self._ended.items()):
                if now - at > CLAIM_BACKSTOP * t:
                    del self._ended[room]


def _why(reason) -> str:
    if reason is None:
        return "the prefill request ended"
    return f"the prefill request ended ({reason.type}{': ' + reason.message if reason.message else ''})"
