"""The prefill side's bootstrap endpoint, run by the I/O thread (``endpoint.py``): claims,
acknowledgements and failures from decode servers, the KV sent to a room's claimant, the timeouts.

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
import time
from collections.abc import Callable

import msgspec
import zmq

from ..errors import ValidationError
from ..memory.pools import KVBuffer
from . import kv_copy, wire
from .auth import TO_DECODE, TO_PREFILL, Opener, Sealers
from .endpoint import CHUNK_TOKENS, Endpoint, RefusalLog, peer_address, tcp_endpoint
from .prefill_rooms import PendingClaim, PrefillRooms, SendJob, send_refusal

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


class PrefillBootstrap(PrefillRooms):
    """The bootstrap port and what the I/O thread does with its messages; ``prefill.py``'s connector
    is the engine thread's side of the same books."""

    def __init__(
        self,
        kv: KVBuffer,
        page_size: int,
        timeout_s: float,
        abort: AbortFn | None,
        data,
        limits,
        kv_heads: int | None,
        key: bytes | None,
        max_claims_per_peer: int,
    ) -> None:
        super().__init__(kv_copy.layout_of(kv, kv_heads))
        self.kv, self.page_size, self.timeout_s = kv, page_size, timeout_s
        self.opener = Opener(key, TO_PREFILL)  # what decode servers send here
        self.sealers = Sealers(key, TO_DECODE)  # one sending session per decode connection
        self.max_claims_per_peer = max_claims_per_peer
        self._refused_log = RefusalLog("prefill")
        self.limits = limits  # the engine's Limits: a prompt a claim carries is checked against them
        self.abort = abort or (lambda *a: None)
        self.data = data  # a MooncakeData (mooncake.py), or None: KV goes as KVData frames

    def _listen(self, bind_host: str, port: int) -> None:
        """Bind the bootstrap port and start the I/O thread (the last step of building the connector)."""
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

    def _send(self, peer: bytes, msg, payload=None) -> None:
        frames = [peer, *wire.pack(msg, self.sealers(peer), payload)]
        self.sock.send_multipart(frames, copy=payload is None)

    def _refuse(self, why: str, *args) -> None:
        """Count a refused message and say why (at most once a second); it is never answered."""
        self.stats.frames_refused += 1
        self._refused_log(why, *args)

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
                self._claims[claim.room] = PendingClaim(peer, claim, at)
                return
            self._start(job, peer, claim)

    def _start(self, job: SendJob, peer: bytes, claim: wire.Claim) -> None:
        """Send the room's KV (caller holds the lock). A refused claim is counted and answered; the
        job waits on for the right claimant (or its timeout)."""
        why = send_refusal(job, peer, claim, self.layout, self.data is not None)
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

