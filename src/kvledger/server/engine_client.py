"""The front's handle on the engine process: start, talk over ZMQ, notice death, restart."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ..common import FinishReason, RequestOutput, SamplingParams
from ..common import messages as m
from ..common.disagg import DisaggParams
from ..common.pooling import PoolingParams
from ..config import EngineConfig
from ..errors import ConflictError, ModelLoadError, ServiceUnavailable, error_for_status
from ..launch.process import engine_main, ipc_paths

log = logging.getLogger("kvledger.server")

# An engine that dies before it is ready (a load that crashes, an OOM kill while loading) is tried
# this many times in a row, pausing START_BACKOFF_S[i] before try i + 2, then given up: restarting
# a start that keeps failing only reloads the model forever. One that dies after serving restarts at once.
START_ATTEMPTS = 3
START_BACKOFF_S = (1.0, 2.0)
# /health reports an engine whose step has not ended for this fraction of --watchdog-timeout (the
# engine sends something after every step, and a heartbeat every 0.5 s when idle): a load balancer
# takes the server out before the watchdog kills the step. Without a watchdog, after STALL_S_NO_WATCHDOG.
STALL_FRACTION = 0.5
STALL_S_NO_WATCHDOG = 30.0


class EngineClient:
    """Owns the engine process. Each request gets an asyncio.Queue of ``RequestOutput``s from the
    engine; a final one has ``finished`` set. If the engine dies, every open queue gets a 503 final
    and a new engine starts; if it cannot be started (it reports why, or dies ``START_ATTEMPTS``
    times in a row before it is ready), ``fatal`` says why and ``on_fatal`` is called, once."""

    def __init__(
        self,
        cfg: EngineConfig,
        log_level: str = "info",
        ready_timeout_s: float = 600.0,
        watchdog_timeout_s: float | None = 60.0,
    ):
        self.cfg = cfg
        self.watchdog_timeout_s = watchdog_timeout_s
        self.last_msg = time.monotonic()
        self.on_stall: Callable[[], None] | None = None
        self.log_level = log_level
        self.ready_timeout_s = ready_timeout_s
        self.ipc_dir = tempfile.mkdtemp(prefix="kvledger-")
        os.chmod(self.ipc_dir, 0o700)  # private: only this user may talk to the engine
        self.ctx = zmq.asyncio.Context()
        self.generation = 0
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.push: zmq.asyncio.Socket | None = None
        self.pull: zmq.asyncio.Socket | None = None
        self.ready = False
        self.info: dict = {}
        self.limits: dict = {}
        self.engine_config: dict = {}
        self.stats: dict = {}
        self.streams: dict[str, asyncio.Queue] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._blocking_calls = 0  # control calls in flight during which the engine does not step
        self._tasks: list[asyncio.Task] = []
        self._ready_event = asyncio.Event()
        self._closing = False
        self.restarts = 0
        self.start_failures = 0  # engines in a row that died before they were ready
        self._gen_ready = False  # the current engine has been ready (sent Ready)
        self._closed = False
        self.fatal: str | None = None
        self.on_stats: Callable[[dict], None] | None = None
        self.on_death: Callable[[], None] | None = None
        # Called once when the engine cannot be (re)started: the server stops (exit non-zero).
        self.on_fatal: Callable[[str], None] | None = None
        # Awaited when a restarted engine is up, before it takes requests (sessions are re-opened).
        self.on_restart: Callable[[], Awaitable[None]] | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the engine and its monitor; ``wait_ready`` waits for the model to load."""
        self._spawn()
        self._tasks.append(asyncio.create_task(self._monitor()))

    async def wait_ready(self) -> None:
        try:
            await asyncio.wait_for(self._ready_event.wait(), self.ready_timeout_s)
        except TimeoutError:
            raise ServiceUnavailable("the engine did not become ready in time") from None
        if self.fatal:
            raise ModelLoadError(self.fatal)

    def _spawn(self) -> None:
        self.generation += 1
        self._gen_ready = False
        to_engine, from_engine = ipc_paths(self.ipc_dir, self.generation)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(to_engine)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(from_engine)
        mp = multiprocessing.get_context("spawn")
        cfg = self.cfg.flat()
        self.proc = mp.Process(
            target=engine_main,
            args=(cfg, self.ipc_dir, self.generation, self.log_level),
            daemon=True,
            name=f"kvledger-engine-{self.generation}",
        )
        self.proc.start()
        log.info("engine process %d started (generation %d)", self.proc.pid, self.generation)
        self._tasks.append(asyncio.create_task(self._recv(self.pull)))

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
            self._gen_ready, self.start_failures = True, 0
            self.info, self.limits, self.engine_config = msg.info, msg.limits, msg.config
            if self.generation > 1 and self.on_restart is not None:
                self._tasks.append(asyncio.create_task(self._restarted(msg.pid)))
            else:
                self._set_ready(msg.pid)
        elif isinstance(msg, m.Fatal):  # it cannot load: restarting would only loop
            self._give_up(msg.message)

    def _give_up(self, reason: str) -> None:
        """The engine cannot be started: say why once, wake ``wait_ready``, tell the server."""
        if self.fatal is not None:
            return
        self.fatal = reason
        log.error("the engine cannot be started: %s", reason)
        self._ready_event.set()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _set_ready(self, pid: int) -> None:
        self.ready = True
        self._ready_event.set()
        log.info("engine ready (pid %s)", pid)

    async def _restarted(self, pid: int) -> None:
        try:
            await self.on_restart()
        except Exception:  # a restore that fails must not keep the server down
            log.exception("restoring state on the restarted engine failed")
        self._set_ready(pid)

    async def _monitor(self) -> None:
        """Notice an engine death within ~0.1 s: fail in-flight requests with 503, start a new engine.
        Ends when the client closes or the engine cannot be started (``fatal``)."""
        while not self._closing and self.fatal is None:
            await asyncio.sleep(0.1)
            wd = self.watchdog_timeout_s
            if (
                wd
                and not self._blocking_calls
                and self.ready
                and self.proc is not None
                and self.proc.is_alive()
                and time.monotonic() - self.last_msg > wd
            ):
                # The engine sends something every step and a heartbeat every 0.5 s when idle:
                # silence means a step that does not end. Policy: kill it; the code below restarts it.
                log.error("watchdog: the engine made no progress for %.1f s; restarting it", wd)
                self.ready = False
                if self.on_stall:
                    self.on_stall()
                self.proc.kill()
                self.proc.join(timeout=5)
            if self.proc is not None and not self.proc.is_alive() and not self._closing:
                await self._on_engine_death(self.proc.exitcode)

    async def _on_engine_death(self, code: int | None) -> None:
        """Fail what was in flight; start a new engine, at once if this one had been ready, after a
        pause if it died starting, or give up after ``START_ATTEMPTS`` such deaths in a row."""
        self.ready = False
        self._ready_event.clear()
        starting = not self._gen_ready
        if starting:
            self.start_failures += 1
        log.error(
            "engine process died%s (exit code %s); failing %d in-flight requests",
            " while starting" if starting else "",
            code,
            len(self.streams),
        )
        self._fail_all("the engine process died; retry the request")
        if self.on_death:
            self.on_death()
        if self.start_failures >= START_ATTEMPTS:
            self._give_up(
                f"the engine process died {self.start_failures} times in a row before it was ready "
                f"(last exit code {code}); the log above says why"
            )
            return
        for s in (self.push, self.pull):
            if s is not None:
                s.close(linger=0)
        if self.start_failures:
            pause = START_BACKOFF_S[min(self.start_failures, len(START_BACKOFF_S)) - 1]
            log.warning(
                "starting the engine again in %.0f s (try %d of %d)", pause, self.start_failures + 1, START_ATTEMPTS
            )
            await asyncio.sleep(pause)
        self.restarts += 1
        self.last_msg = time.monotonic()
        self._spawn()

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

    async def close(self) -> None:
        """Stop the engine: a ready one is asked to shut down (its sessions close), one that is still
        starting is terminated at once (it reads no message until it is ready). Idempotent."""
        if self._closed:
            return
        self._closed = self._closing = True
        for t in self._tasks:
            t.cancel()
        if self.proc is not None and self.proc.is_alive():
            if self._gen_ready:
                with contextlib.suppress(Exception):
                    await self.push.send(m.encode(m.Shutdown()))
                self.proc.join(timeout=3)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=3)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=3)
        for s in (self.push, self.pull):
            if s is not None:
                s.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

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
        await self.push.send(m.encode(m.AddRequest(rid, input_ids, params, session_params, disagg, pooling)))
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

    def alive(self) -> bool:
        return self.ready and self.proc is not None and self.proc.is_alive()

    @property
    def stall_limit_s(self) -> float:
        """Seconds of silence after which the engine's step counts as stuck (``stalled_for``)."""
        wd = self.watchdog_timeout_s
        return wd * STALL_FRACTION if wd else STALL_S_NO_WATCHDOG

    def stalled_for(self) -> float | None:
        """How long the engine's current step has run when that is past ``stall_limit_s`` (None: it is
        not stuck). A blocking control call (a weight load) is not a stall: the engine does not step
        while it runs it, as the watchdog knows."""
        if not self.ready or self._blocking_calls:
            return None
        silent = time.monotonic() - self.last_msg
        return silent if silent > self.stall_limit_s else None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None
