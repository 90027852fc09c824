"""The decode side's I/O thread (``endpoint.py``): its connections to the prefill servers, the frames
that come back (KV written in place, prefill's first token, failures), the timeouts; and the books of
the rooms it waits on, which the engine thread's connector (``decode.py``) keeps too.

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

from ..memory.pools import KVBuffer
from . import kv_copy, wire
from .auth import TO_DECODE, TO_PREFILL, Opener, Sealer
from .endpoint import CHUNK_TOKENS, Endpoint, RefusalLog, TransferStats, tcp_endpoint
from .tp import RankHeads

log = logging.getLogger("kvledger.disagg")

# abort(rid, message, status, code): ends a request at the next safe point (thread-safe)
AbortFn = Callable[[str, str, int, str], None]


@dataclass
class RecvJob:
    """A room's KV on its way in: where it goes (``locs``), how far it came, and whether it ended."""

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


class DecodeReceiver:
    """The rooms' books and the I/O thread's handlers; ``DecodeConnector`` is the engine thread's side."""

    def __init__(
        self,
        kv: KVBuffer,
        timeout_s: float,
        abort: AbortFn,
        heads: RankHeads | None,
        kv_heads: int | None,
        key: bytes | None,
        host_sink,
    ) -> None:
        self.kv, self.key = kv, key
        self.opener = Opener(key, TO_DECODE)  # what prefill servers send here
        self._sealers: dict[str, Sealer] = {}  # prefill address -> this side's session on that connection
        self._refused_log = RefusalLog("decode")
        self.timeout_s, self.abort = timeout_s, abort
        self.heads = heads  # tensor parallel: rank 0's part of placing every rank's heads (tp.py)
        self.host_sink = host_sink  # HiSparse's SparseWorker (model/hisparse.py): KV may land in its host pool
        self.layout = kv_copy.layout_of(kv, kv_heads)
        self._to_place: list[RecvJob] = []  # received whole, not placed yet (tensor parallel)
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._live: dict[int, str] = {}  # room -> rid, from submit to the end
        self._jobs: dict[int, RecvJob] = {}  # room -> admitted, KV arriving
        self._recv_done: set[str] = set()
        self._first: dict[str, wire.Done] = {}  # rid -> prefill's first token, until the request takes it
        self._received: set[str] = set()  # rids whose KV came in (a retraction then recomputes locally)
        # Mooncake: room -> (rid, deadline) of an ended request whose pages wait for prefill to stop
        # writing; its rid is reported in get_finished's first set when it has.
        self._draining: dict[int, tuple[str, float]] = {}
        self._drained: set[str] = set()
        self._dealers: dict[str, zmq.Socket] = {}  # prefill address -> socket (I/O thread only)
        self.io = Endpoint("kvledger-pd-decode")

    def _start_io(self) -> None:
        """Start the I/O thread (the last step of building the connector)."""
        self.io.on_frames, self.io.on_post, self.io.on_tick = self._on_frames, self._on_post, self._on_tick
        self.io.start()

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

    def _fail(self, job: RecvJob, message: str, code: str, tell_prefill: bool) -> None:
        """End ``job``'s request with a 502 (caller holds no lock). Its pages go at the next safe
        point, through the release path (``request_finished`` cancels the job)."""
        with job.lock:
            if job.cancelled or job.done:
                return
            job.cancelled = True
        self.abort(job.rid, message, 502, code)
        if tell_prefill:
            self._on_post(("send", job.addr, wire.Fail(job.room, message)))

    def _refuse(self, addr: str, why: str, job: RecvJob | None = None) -> None:
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

    def _on_data(self, job: RecvJob, msg: wire.KVData, payload: memoryview, addr: str) -> None:
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

    def _on_done(self, job: RecvJob, msg: wire.Done, addr: str) -> None:
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
