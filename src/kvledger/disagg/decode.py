"""The decode side: pre-allocate a request's slot and pages, claim its room at the prefill server,
write the arriving KV straight into those pages, then join the request to decoding with the first
token prefill sampled.

Ledger: from admission until the KV is in, the request holds its slot and pages in the state
``req X [waiting for kv]`` (the scheduler's WAITING_FOR_KV). Every way out goes through the one
release path: the transfer completes (the request decodes on; a request already finished by its
first token -- max_new_tokens 1, EOS -- ends at once, the "prebuilt" finish of seed 003), the prefill
side fails or refuses, the wait times out, or the client aborts. An abort takes the job's lock, so
no frame is written into pages after they were released.

Under tensor parallelism (``tp.py``) the frames are staged on rank 0 instead (one block of every head
per request, exactly its claimed tokens), and the step after the last frame places each rank's heads
into the pages; the request is reported received after that step.

Frames are checked before anything is written: a message whose seal does not open under the PD
nodes' key (``auth.py``: forged, replayed, or from a peer without the key), a room this side does not
hold, from another peer, out of order, or with the wrong number of bytes is refused and counted (a
wrong size also fails the request: its transfer is broken). This side listens on nothing: its
DEALER sockets connect out, and only to the prefill servers it was given (``PrefillPeers``: a
request naming another is refused with a 400 before anything is held or connected).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from ..common.disagg import PrefillPeers
from ..connector import KVConnector, Received
from ..errors import ConflictError
from ..memory.pools import KVBuffer
from . import kv_copy, wire
from .auth import TO_DECODE, TO_PREFILL, Opener, Sealer
from .endpoint import CHUNK_TOKENS, Endpoint, RefusalLog, TransferStats, tcp_endpoint
from .tp import PDMeta, RankHeads

log = logging.getLogger("kvledger.disagg")

# abort(rid, message, status, code): ends a request at the next safe point (thread-safe)
AbortFn = Callable[[str, str, int, str], None]


@dataclass
class _RecvJob:
    rid: str
    room: int
    addr: str
    start: int
    num_tokens: int
    locs: torch.Tensor  # cache locations of positions start..num_tokens
    deadline: float
    next: int = 0  # the next position expected
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    done: bool = False
    direct: bool = False  # claimed with a Mooncake target: prefill may write into the pages itself
    prefill_stopped: bool = False  # prefill said it will write no more (Done or Fail)
    created: float = field(default_factory=time.monotonic)
    # Tensor parallel: every head of the claimed tokens, as received (rank 0), until a step places it
    # on the ranks; ``first`` is prefill's Done, reported with the request once placed.
    staged: torch.Tensor | None = None
    first: wire.Done | None = None
    to_host: bool = False  # HiSparse: ``locs`` are host-pool locations (``host_sink.write``)


class DecodeConnector(KVConnector):
    external_tokens_are_cached = False  # prefill computed (or cached) them: it says which in Done
    def __init__(
        self,
        kv: KVBuffer,
        page_size: int,
        default_port: int,
        timeout_s: float,
        abort: AbortFn,
        data=None,
        heads: RankHeads | None = None,
        kv_heads: int | None = None,
        key: bytes | None = None,
        peers: PrefillPeers | None = None,
        host_sink=None,
    ):
        """``key``: the PD nodes' shared key (``auth.py``; None: unauthenticated, loopback only);
        ``peers``: the prefill servers a request may name (None: loopback at ``default_port``);
        ``host_sink``: HiSparse's ``SparseWorker`` (``model/hisparse.py``), whose host pool KV may land in."""
        self.kv, self.page_size, self.default_port = kv, page_size, default_port
        self.peers = peers or PrefillPeers(None, default_port)
        self.key = key
        self.opener = Opener(key, TO_DECODE)  # what prefill servers send here
        self._sealers: dict[str, Sealer] = {}  # prefill address -> this side's session on that connection
        self._refused_log = RefusalLog("decode")
        self.data = data  # a MooncakeData (mooncake.py): claims ask prefill to write the pages directly
        self.timeout_s, self.abort = timeout_s, abort
        self.heads = heads  # tensor parallel: rank 0's part of placing every rank's heads (tp.py)
        self.host_sink = host_sink  # HiSparse's SparseWorker (model/hisparse.py): KV may land in its host pool
        self.layout = kv_copy.layout_of(kv, kv_heads)
        self._to_place: list[_RecvJob] = []  # received whole, not placed yet (tensor parallel)
        self._placing: list[_RecvJob] = []  # ... placed by the step being run
        self._meta_at = 0.0  # when that step's meta was built (TransferStats.tp_copy_seconds)
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._live: dict[int, str] = {}  # room -> rid, from submit to the end
        self._jobs: dict[int, _RecvJob] = {}  # room -> admitted, KV arriving
        self._recv_done: set[str] = set()
        self._first: dict[str, wire.Done] = {}  # rid -> prefill's first token, until the request takes it
        self._received: set[str] = set()  # rids whose KV came in (a retraction then recomputes locally)
        # Mooncake: room -> (rid, deadline) of an ended request whose pages wait for prefill to stop
        # writing; its rid is reported in get_finished's first set when it has.
        self._draining: dict[int, tuple[str, float]] = {}
        self._drained: set[str] = set()
        self._dealers: dict[str, zmq.Socket] = {}  # prefill address -> socket (I/O thread only)
        self.io = Endpoint("kvledger-pd-decode")
        self.io.on_frames, self.io.on_post, self.io.on_tick = self._on_frames, self._on_post, self._on_tick
        self.io.start()

    def _addr(self, d) -> str:
        return self.peers.address(d)

    # -- scheduler side (engine thread) -----------------------------------------------------------------
    def check_peer(self, d) -> None:
        """400 (``bootstrap_host``) unless ``d`` names a prefill server this side may connect to: checked
        when the request is submitted, before anything is held or connected."""
        self.peers.check(d)

    def check_request(self, req) -> None:
        d = req.disagg
        if d is None or d.fake:
            return
        with self._lock:
            if d.room in self._live:
                raise ConflictError(f"bootstrap_room {d.room} is already in use", param="bootstrap_room")
            self._live[d.room] = req.rid

    def request_refused(self, req, why: str) -> None:
        d = req.disagg
        if d is None or d.fake or not self.peers.allows(d):
            return  # (a peer it may not reach is not told either)
        # Refused here (a session turn too long, its session busy or gone, the queue full): the
        # prefill side's request for this room would otherwise wait out its bootstrap timeout.
        self.io.post(("send", self._addr(d), wire.Fail(d.room, f"the decode server refused the request: {why}")))

    @property
    def lands_in_host(self) -> bool:
        """KV for a HiSparse request can be written into its host pages (the built-in transport, one
        rank; Mooncake writes registered KV-pool memory, and TP stages heads per rank)."""
        return self.host_sink is not None and self.data is None and self.heads is None

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int, bool]:
        if req.disagg is None or req.output_ids or req.rid in self._received:
            return 0, False  # a direct request, or one retracted after its KV came: computed here
        return len(req.input_ids) - num_computed_tokens, True  # all of it, and prefill's first token

    def update_state_after_alloc(self, req, pages: list[int], num_external_tokens: int) -> None:
        d = req.disagg
        # The rest of the prompt: what decode's own cache (its prefix match, a tier's load before
        # this part) does not hold.
        end = len(req.input_ids)
        start = end - num_external_tokens
        if d.fake:
            # A health check: no KV moves. The pages hold whatever they held, so the request's KV
            # must never reach the prefix cache.
            req.kv_trusted = False
            with self._lock:
                self._first[req.rid] = wire.Done(d.room, end, 0)
                self._recv_done.add(req.rid)
            return
        if not self.peers.allows(d):  # refused at submit (check_peer); never connect there
            why = f"bootstrap_host {d.host} is not an allowed prefill server"
            self.abort(req.rid, why, 400, "bootstrap_host")
            return
        ps = self.page_size
        to_host = req.sparse is not None and req.sparse.host_from is not None  # (``lands_in_host``)
        locs = kv_copy.locations(req.sparse.host if to_host else req.pages, ps, start, end)
        job = _RecvJob(
            req.rid, d.room, self._addr(d), start, end, locs, time.monotonic() + self.timeout_s, start
        )
        job.to_host = to_host
        target = None
        if self.data is not None:
            target = self.data.target(req.pages[start // ps : -(-end // ps)], ps)
            job.direct = True
        with self._lock:
            self._jobs[d.room] = job
        # A session turn's prompt is the session's history + its input: only this side knows it, so
        # the claim carries it (prefill was sent the turn's input alone). ``start`` is what the
        # session's borrowed pages already hold; prefill sends the rest.
        tokens = list(req.input_ids) if req.session is not None else None
        claim = wire.Claim(d.room, end, start, wire.tokens_crc(req.input_ids, req.lora_key), self.layout, target, tokens)
        self.io.post(("send", job.addr, claim))

    def received_output(self, req):
        with self._lock:
            done = self._first.pop(req.rid, None)
        if done is None:
            return None
        # A peer's number is clamped to the prompt: it only ever feeds a usage figure.
        cached = min(max(done.cached_tokens, 0), len(req.input_ids))
        return Received([done.first_token], [done.logprob], [done.top_logprobs], cached)

    def request_finished(self, req) -> bool:
        d = req.disagg
        if d is None:
            return False
        with self._lock:
            self._live.pop(d.room, None)
            self._first.pop(req.rid, None)
            self._recv_done.discard(req.rid)
            received = req.rid in self._received
            self._received.discard(req.rid)
            job = self._jobs.pop(d.room, None) if not d.fake else None
        if job is not None:
            with job.lock:  # after this no frame is written into the request's pages
                job.cancelled = True
            self._unstage(job)
        if not d.fake and not received and (job is None or not job.done):
            # Ended before its KV came (aborted, refused in the queue, needs none): let prefill free.
            drain = job is not None and job.direct and not job.prefill_stopped
            if drain:
                # Prefill may be writing into these pages right now: keep them until it says it
                # stopped (or the timeout passes). Noted before the Fail goes: its answer may come
                # back at once (a claim prefill had not started on).
                with self._lock:
                    self._draining[d.room] = (req.rid, time.monotonic() + self.timeout_s)
            self.io.post(("send", self._addr(d), wire.Fail(d.room, _why(req.to_finish))))
            return drain
        return False

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            done, self._recv_done = self._recv_done, set()
            self._received |= done
            drained, self._drained = self._drained, set()
        return drained, done

    def close(self) -> None:
        self.io.close()

    def build_connector_meta(self, sched_out) -> PDMeta | None:
        """Tensor parallel: the received blocks every rank places its heads of in this step."""
        if self.heads is None:
            return None
        with self._lock:
            jobs, self._to_place = [j for j in self._to_place if not j.cancelled], []
            for j in jobs:
                if j.staged is None:  # nothing to place (decode's own cache had it all)
                    self._first[j.rid] = j.first
                    self._recv_done.add(j.rid)
            self._placing = [j for j in jobs if j.staged is not None]
        if not self._placing:
            return None
        self._meta_at = time.perf_counter()
        return PDMeta(self.layout.kv_heads, place=[j.locs for j in self._placing])

    @property
    def has_pending(self) -> bool:
        return bool(self._to_place or self._placing)

    def _unstage(self, job: _RecvJob) -> None:
        with self._lock:
            if job.staged is not None:
                self.stats.stage(-job.staged.nbytes)
                job.staged = None

    # -- rank 0's worker side (tensor parallel) ---------------------------------------------------------
    def start_load_kv(self, meta: PDMeta | None, kv_buffer) -> None:
        if self.heads is None:
            return
        jobs, self._placing = self._placing, []
        # Every rank writes its heads before this step's forward.
        self.heads.apply(meta, kv_buffer, [j.staged for j in jobs])
        if jobs:
            self.stats.tp_copy_seconds += time.perf_counter() - self._meta_at
        for job in jobs:
            self._unstage(job)
            with self._lock:
                self._first[job.rid] = job.first
                self._recv_done.add(job.rid)

    # -- the I/O thread ---------------------------------------------------------------------------------
    def _dealer(self, addr: str) -> zmq.Socket:
        sock = self._dealers.get(addr)
        if sock is None:
            host, _, port = addr.rpartition(":")
            sock = self.io.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # A frame larger than the biggest a prefill server sends drops the connection in ZMQ.
            biggest = max(wire.MAX_HEADER_BYTES, CHUNK_TOKENS * self.layout.bytes_per_token)
            sock.setsockopt(zmq.MAXMSGSIZE, biggest + 4096)
            sock.setsockopt(zmq.IPV6, host.startswith("["))
            sock.connect(tcp_endpoint(host.strip("[]"), int(port)))
            self._dealers[addr] = sock
            self._sealers[addr] = Sealer(self.key, TO_PREFILL)
            self.io.watch(sock, addr)
        return sock

    def _on_post(self, item) -> None:
        _, addr, msg = item
        try:
            sock = self._dealer(addr)
            sock.send_multipart(wire.pack(msg, self._sealers[addr]), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("PD decode: cannot send to prefill %s: %s", addr, e)

    def _fail(self, job: _RecvJob, message: str, code: str, tell_prefill: bool) -> None:
        """End ``job``'s request with a 502 (caller holds no lock). Its pages go at the next safe
        point, through the release path (``request_finished`` cancels the job)."""
        with job.lock:
            if job.cancelled or job.done:
                return
            job.cancelled = True
        self.abort(job.rid, message, 502, code)
        if tell_prefill:
            self._on_post(("send", job.addr, wire.Fail(job.room, message)))

    def _refuse(self, addr: str, why: str, job: _RecvJob | None = None) -> None:
        self.stats.frames_refused += 1
        self._refused_log("refused a frame from %s: %s", addr, why)
        if job is not None:
            self.stats.transfers_failed += 1
            self._fail(job, f"KV transfer refused: {why}", "kv_transfer_refused", tell_prefill=True)

    def _on_frames(self, _sock, addr: str, frames) -> None:
        try:
            msg, payload = wire.unpack(frames, self.opener)
        except wire.WireError as e:
            return self._refuse(addr, str(e))
        with self._lock:
            job = self._jobs.get(msg.room)
            draining = self._draining.get(msg.room) if job is None else None
            if draining is not None and isinstance(msg, wire.Done | wire.Fail):
                del self._draining[msg.room]
                self._drained.add(draining[0])  # prefill has stopped writing: the pages may go
                return None
        if job is None or job.addr != addr:
            return self._refuse(addr, f"room {msg.room} is not expected from this prefill server")
        if isinstance(msg, wire.KVData):
            self._on_data(job, msg, payload, addr)
        elif isinstance(msg, wire.Done):
            self._on_done(job, msg, addr)
        elif isinstance(msg, wire.Fail):
            job.prefill_stopped = True
            self.stats.transfers_failed += 1
            self._fail(
                job, f"the prefill server failed this request: {msg.reason}", "kv_transfer_failed", False
            )
        else:
            self._refuse(addr, f"a {type(msg).__name__} message is not for a decode side", job)

    def _on_data(self, job: _RecvJob, msg: wire.KVData, payload: memoryview, addr: str) -> None:
        want = msg.count * self.layout.bytes_per_token
        if msg.start != job.next or msg.count <= 0 or msg.start + msg.count > job.num_tokens:
            why = f"tokens {msg.start}+{msg.count} where {job.next}..{job.num_tokens} are expected"
            return self._refuse(addr, why, job)
        if payload.nbytes != want:
            return self._refuse(addr, f"{payload.nbytes} bytes for {msg.count} tokens (want {want})", job)
        with job.lock:
            if job.cancelled:
                return
            a = msg.start - job.start
            if job.to_host:  # HiSparse: into the request's host pages
                blk = kv_copy.from_bytes(payload, self.kv.k.dtype, self.layout, msg.count)
                self.host_sink.write(job.locs[a : a + msg.count], blk)
            elif self.heads is None:
                kv_copy.scatter(self.kv, job.locs[a : a + msg.count], payload, self.layout)
            else:  # tensor parallel: staged whole until a step places each rank's heads
                if job.staged is None:
                    n, lay = job.num_tokens - job.start, self.layout
                    shape = (2, lay.num_layers, lay.kv_heads, n, lay.head_dim)
                    job.staged = torch.empty(shape, dtype=self.kv.k.dtype)
                    with self._lock:
                        self.stats.stage(job.staged.nbytes)
                blk = kv_copy.from_bytes(payload, self.kv.k.dtype, self.layout, msg.count)
                job.staged[:, :, :, a : a + msg.count] = blk
            job.next += msg.count
        self.stats.kv_frames += 1

    def _on_done(self, job: _RecvJob, msg: wire.Done, addr: str) -> None:
        job.prefill_stopped = True
        complete = job.next == job.num_tokens or (msg.direct and job.direct)
        if msg.num_tokens != job.num_tokens or not complete:
            return self._refuse(addr, f"done at {job.next} of {job.num_tokens} tokens", job)
        with job.lock:
            if job.cancelled:
                return
            job.done = True
            with self._lock:
                if self.heads is None:
                    self._first[job.rid] = msg
                    self._recv_done.add(job.rid)
                else:  # placed on every rank by the next step, then reported
                    job.first = msg
                    self._to_place.append(job)
        st = self.stats
        st.transfers_ok += 1
        st.tokens += job.num_tokens - job.start
        st.bytes += (job.num_tokens - job.start) * self.layout.bytes_per_token
        st.seconds += time.monotonic() - job.created
        self._on_post(("send", addr, wire.Ack(job.room)))

    def _on_tick(self, now: float) -> None:
        with self._lock:
            late = [j for j in self._jobs.values() if not j.done and not j.cancelled and now > j.deadline]
            for room, (rid, deadline) in list(self._draining.items()):
                if now > deadline:
                    log.warning(
                        "PD decode: room %d: prefill never confirmed it stopped; pages released", room
                    )
                    del self._draining[room]
                    self._drained.add(rid)
        for job in late:
            self.stats.transfers_timed_out += 1
            log.warning("PD decode: room %d: no KV from %s in %.0fs", job.room, job.addr, self.timeout_s)
            msg = f"timed out after {self.timeout_s:.0f}s waiting for KV from the prefill server {job.addr}"
            self._fail(job, msg, "kv_transfer_timeout", tell_prefill=True)


def _why(reason) -> str:
    if reason is None:
        return "the decode request ended"
    return f"the decode request ended ({reason.type}{': ' + reason.message if reason.message else ''})"
