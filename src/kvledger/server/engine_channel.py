"""The typed messages between the front and its engine process, over ZMQ (``common/messages.py``):
the receive loop, each step's outputs routed to their request's queue, control calls and their
replies, a request's submit and abort. ``EngineClient`` (``engine_client.py``) owns the process behind
the sockets: its start, death and restart."""

from __future__ import annotations

import abc
import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ..common import FinishReason, RequestOutput, SamplingParams
from ..common import messages as m
from ..common.disagg import DisaggParams
from ..common.pooling import PoolingParams
from ..errors import ConflictError, ServiceUnavailable, error_for_status

log = logging.getLogger("kvledger.server")


class EngineChannel(abc.ABC):
    """The front's side of the engine's sockets. Each request gets an asyncio.Queue of
    ``RequestOutput``s; a final one has ``finished`` set. What the engine's ``Ready`` and ``Fatal``
    mean for the process is the owner's (``_on_ready``, ``_give_up``)."""

    def __init__(self) -> None:
        self.last_msg = time.monotonic()
        self.ctx = zmq.asyncio.Context()
        self.push: zmq.asyncio.Socket | None = None
        self.pull: zmq.asyncio.Socket | None = None
        self.ready = False
        self.stats: dict = {}
        self.streams: dict[str, asyncio.Queue] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._blocking_calls = 0  # control calls in flight during which the engine does not step
        self.on_stats: Callable[[dict], None] | None = None

    @abc.abstractmethod
    def _on_ready(self, msg: m.Ready) -> None:
        """The engine loaded and takes requests."""

    @abc.abstractmethod
    def _give_up(self, reason: str) -> None:
        """The engine cannot be started (``Fatal``): restarting it would only loop."""

    def _close_sockets(self) -> None:
        for s in (self.push, self.pull):
            if s is not None:
                s.close(linger=0)

    async def _recv(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frame = await sock.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self.last_msg = time.monotonic()
            try:
                msg = m.decode_from_engine(frame)
            except msgspec.ValidationError as e:
                log.error("dropped a malformed message from the engine: %s", e)
                continue
            self._on_message(msg)
            # Let the streams consume this step's output before the next frame is taken: each step
            # becomes its own SSE event instead of several steps coalescing into one.
            await asyncio.sleep(0)

    def _on_message(self, msg) -> None:
        if isinstance(msg, m.Outputs):
            for item in msg.items:
                q = self.streams.get(item.rid)
                if q is not None:
                    q.put_nowait(item)
                    if item.finished:
                        self.streams.pop(item.rid, None)
            if msg.stats is not None:
                self.stats = msg.stats
                if self.on_stats:
                    self.on_stats(self.stats)
        elif isinstance(msg, m.Reply):
            fut = self._replies.pop(msg.id, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    e = msg.error
                    fut.set_exception(
                        error_for_status(
                            int(e.get("status", 500)),
                            e.get("message") or "engine error",
                            e.get("code"),
                            e.get("param"),
                        )
                    )
                else:
                    fut.set_result(msg.result)
        elif isinstance(msg, m.Ready):
            self._on_ready(msg)
        elif isinstance(msg, m.Fatal):  # it cannot load: restarting would only loop
            self._give_up(msg.message)

    def _fail_all(self, message: str) -> None:
        streams, self.streams = self.streams, {}
        for rid, q in streams.items():
            q.put_nowait(
                RequestOutput.final(rid, FinishReason("abort", message, status=503, code="engine_died"))
            )
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(ServiceUnavailable(message))
        self._replies.clear()

    # -- requests ----------------------------------------------------------------------------------------
    def _check_ready(self) -> None:
        if not self.ready:
            raise ServiceUnavailable(
                "the engine is not ready (starting or restarting); retry shortly", code="engine_not_ready"
            )

    async def submit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        session_params: dict | None = None,
        disagg: DisaggParams | None = None,
        pooling: PoolingParams | None = None,
        images: list[m.WireImage] | None = None,
    ) -> asyncio.Queue:
        """Send a request; its outputs arrive on the returned queue. The front's one duplicate-rid
        check (streams are keyed by rid); the engine checks again, as the authority."""
        self._check_ready()
        if rid in self.streams:
            raise ConflictError(
                f"a request with id {rid!r} is already running", param="rid", code="duplicate_rid"
            )
        q: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = q
        await self.push.send(m.encode(m.AddRequest(rid, input_ids, params, session_params, disagg, pooling, images)))
        return q

    async def abort(self, rid: str, message: str = "aborted by the client") -> None:
        if self.ready and self.push is not None:
            await self.push.send(m.encode(m.AbortRequest(rid, message)))

    async def call(self, op: str, wait_s: float = 30.0, *, blocking: bool = False, **args) -> Any:
        """A control operation. ``blocking``: the engine does not step while it runs it (a weight
        load), so the watchdog waits for its reply instead of reading the silence as a stall."""
        self._check_ready()
        if not blocking:
            return await self.call_unchecked(op, wait_s, **args)
        self._blocking_calls += 1
        try:
            return await self.call_unchecked(op, wait_s, **args)
        finally:
            self._blocking_calls -= 1
            self.last_msg = time.monotonic()

    async def call_unchecked(self, op: str, wait_s: float = 30.0, **args) -> Any:
        """``call`` before the engine is marked ready (``on_restart`` uses it)."""
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[i] = fut
        await self.push.send(m.encode(m.Call(i, op, args)))
        return await asyncio.wait_for(fut, wait_s)
