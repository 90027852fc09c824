"""The I/O thread each side of the built-in transport runs, and the figures both keep.

ZMQ sockets are not thread-safe: one thread owns them all (the peer sockets and the receiving end of
an in-process wake-up pipe). The engine thread hands it work with ``post`` (a queue plus a wake-up
byte) and never touches a socket itself; the I/O thread reports back through sets the connector
reads under its lock at the engine's safe points (``get_finished``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

import zmq

log = logging.getLogger("kvledger.disagg")

TICK_S = 0.05  # timeouts are checked this often
CHUNK_TOKENS = 256  # tokens per KV frame: bounds one frame (~12 MB for SmolLM2 in fp32)
REFUSAL_LOG_S = 1.0  # at most one warning about refused frames this often (the rest are counted)


@dataclass
class TransferStats:
    """Counters of one side's transfers (``/metrics``, ``/server_info``)."""

    transfers_ok: int = 0
    transfers_failed: int = 0  # the other side failed or aborted
    transfers_timed_out: int = 0
    frames_refused: int = 0  # unauthenticated, replayed, malformed, a foreign room, over a cap: never applied
    tokens: int = 0
    bytes: int = 0
    kv_frames: int = 0  # KVData frames sent/received (0 when Mooncake writes the pages)
    seconds: float = 0.0  # claim -> acknowledged (prefill) / admitted -> received (decode)
    # Tensor parallel (tp.py): bytes of whole-head KV held on rank 0 between the group and the wire
    # (prefill: collected, not sent yet; decode: received, not placed on the ranks yet), and the most.
    staged_bytes: int = 0
    staged_peak_bytes: int = 0
    # ... and rank 0's seconds from a step's connector meta to its heads moved (the step's broadcast
    # of the meta, the gather to rank 0, the copies): what the group adds to a transfer.
    tp_copy_seconds: float = 0.0

    def stage(self, nbytes: int) -> None:
        """``nbytes`` more (or, negative, fewer) staged (under the connector's lock)."""
        self.staged_bytes += nbytes
        self.staged_peak_bytes = max(self.staged_peak_bytes, self.staged_bytes)

    def as_dict(self) -> dict:
        return asdict(self)


class RefusalLog:
    """Warnings about refused frames, at most one per ``REFUSAL_LOG_S``: a peer sending garbage as fast
    as it can must not flood the log (``TransferStats.frames_refused`` counts every one)."""

    def __init__(self, side: str):
        self.side = side
        self._next = 0.0
        self._quiet = 0  # refusals not logged since the last warning

    def __call__(self, fmt: str, *args) -> None:
        now = time.monotonic()
        if now < self._next:
            self._quiet += 1
            return
        more = f" (and {self._quiet} more refused since the last warning)" if self._quiet else ""
        log.warning("PD %s: " + fmt + "%s", self.side, *args, more)
        self._next, self._quiet = now + REFUSAL_LOG_S, 0


def peer_address(frame) -> str:
    """Where a received ZMQ frame came from (``ip:port``, for the log), or ``?``."""
    try:
        return frame.get("Peer-Address")
    except Exception:  # a copied frame, or a transport without the property
        return "?"


def tcp_endpoint(host: str, port: int) -> str:
    """ZMQ's ``tcp://`` address of ``host:port`` (an IPv6 address in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Endpoint:
    """A thread that owns a poller over ZMQ sockets and runs ``on_frames`` / ``on_post`` /
    ``on_tick`` for its connector. Subclasses add sockets with ``watch``."""

    def __init__(self, name: str):
        self.ctx = zmq.Context.instance()
        self.poller = zmq.Poller()
        self._sockets: dict[zmq.Socket, str] = {}
        self._posts: queue.SimpleQueue = queue.SimpleQueue()
        addr = f"inproc://kvledger-wake-{uuid.uuid4().hex}"
        self._wake_rx = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(addr)
        self._wake_tx = self.ctx.socket(zmq.PUSH)  # the engine thread's end (used only there)
        self._wake_tx.connect(addr)
        self.poller.register(self._wake_rx, zmq.POLLIN)
        self._wake_lock = threading.Lock()  # post() may come from a hook on any thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, sock: zmq.Socket, peer: str) -> None:
        """Poll ``sock`` (I/O thread only, or before ``start``)."""
        self._sockets[sock] = peer
        self.poller.register(sock, zmq.POLLIN)

    def post(self, item) -> None:
        """Hand ``item`` to the I/O thread (``on_post``)."""
        with self._wake_lock:
            if self._stop.is_set():
                return  # closed: the thread (and its sockets) are gone
            self._posts.put(item)
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Stop the thread and close the sockets (idempotent)."""
        with self._wake_lock:
            if self._stop.is_set():
                return
            self._stop.set()
            self._wake_tx.send(b"", zmq.NOBLOCK)
        self._thread.join(timeout=2)

    def _run(self) -> None:
        next_tick = time.monotonic() + TICK_S
        while not self._stop.is_set():
            try:
                ready = dict(self.poller.poll(TICK_S * 1000))
                if self._wake_rx in ready:
                    while True:
                        try:
                            self._wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    while True:
                        try:
                            self.on_post(self._posts.get_nowait())
                        except queue.Empty:
                            break
                for sock, peer in list(self._sockets.items()):
                    if sock in ready:
                        self._drain(sock, peer)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK_S
                    self.on_tick(now)
            except Exception:  # the transport must outlive any one bad message
                log.exception("KV transfer I/O thread: unexpected error")
        with self._wake_lock:
            for sock in [*self._sockets, self._wake_rx, self._wake_tx]:
                sock.close(linger=0)

    def _drain(self, sock: zmq.Socket, peer: str) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.on_frames(sock, peer, frames)

    # -- for subclasses ------------------------------------------------------------------------------
    on_frames: Callable
    on_post: Callable
    on_tick: Callable
