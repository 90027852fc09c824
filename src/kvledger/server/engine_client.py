"""The front's handle on the engine process: start it, notice its death, restart it, stop it; the
watchdog. The messages over its sockets are ``EngineChannel``'s (``engine_channel.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import shutil
import signal
import time
from collections.abc import Awaitable, Callable

import zmq

from ..common import messages as m
from ..config import EngineConfig
from ..errors import ModelLoadError, ServiceUnavailable
from .early_engine import EarlyEngine, end_process, private_ipc_dir, spawn_engine
from .engine_channel import EngineChannel

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
# An engine that died of SIGTERM or SIGINT was most likely stopped together with its server: a signal
# to the whole process group (a supervisor stopping ``kvledger serve --dp-size 2``, Ctrl-C) reaches
# the engine and its front at once, and the engine may die before the front's drain begins. Such a
# death is not restarted while the server stops (``expect_stop``, ``close``); the front waits this
# long for its stop to begin, then restarts the engine (someone stopped the engine alone). A crash
# (SIGKILL by the OOM killer, SIGSEGV, a nonzero exit) restarts at once, as it always did.
SIGNAL_DEATH_WAIT_S = 2.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class EngineClient(EngineChannel):
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
        early: EarlyEngine | None = None,
    ):
        """``early``: an engine process already started (``kvledger serve``), adopted as generation 1."""
        super().__init__()
        self.cfg = cfg
        self.watchdog_timeout_s = watchdog_timeout_s
        self.on_stall: Callable[[], None] | None = None
        self.log_level = log_level
        self.ready_timeout_s = ready_timeout_s
        self._early = early
        self.ipc_dir = early.ipc_dir if early is not None else private_ipc_dir()  # only this user's
        self.generation = 0
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.info: dict = {}
        self.limits: dict = {}
        self.engine_config: dict = {}
        self._tasks: list[asyncio.Task] = []
        self._ready_event = asyncio.Event()
        self._closing = False
        self._stopping = False  # the server's drain began (``expect_stop``)
        self.restarts = 0
        self.start_failures = 0  # engines in a row that died before they were ready
        self._gen_ready = False  # the current engine has been ready (sent Ready)
        self._closed = False
        self.fatal: str | None = None
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
        to_engine, from_engine = m.ipc_paths(self.ipc_dir, self.generation)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(to_engine)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(from_engine)
        if self._early is not None:  # generation 1, started before the front's imports
            self.proc, self._early = self._early.proc, None
        else:
            self.proc = spawn_engine(self.cfg, self.ipc_dir, self.generation, self.log_level)
        log.info("engine process %d started (generation %d)", self.proc.pid, self.generation)
        self._tasks.append(asyncio.create_task(self._recv(self.pull)))

    def _on_ready(self, msg: m.Ready) -> None:
        """This generation's engine loaded: a restarted one takes requests once ``on_restart`` ran."""
        self._gen_ready, self.start_failures = True, 0
        self.info, self.limits, self.engine_config = msg.info, msg.limits, msg.config
        if self.generation > 1 and self.on_restart is not None:
            self._tasks.append(asyncio.create_task(self._restarted(msg.pid)))
        else:
            self._set_ready(msg.pid)

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
            dead = self.proc is not None and not self.proc.is_alive() and not self._closing
            if dead and not await self._on_engine_death(self.proc.exitcode):
                return  # stopped with the server, or given up: no engine left to watch

    async def _on_engine_death(self, code: int | None) -> bool:
        """Fail what was in flight; start a new engine, at once if this one had been ready, after a
        pause if it died starting, or give up after ``START_ATTEMPTS`` such deaths in a row. Not when
        it was stopped by a signal with the server (``SIGNAL_DEATH_WAIT_S``). Whether one started."""
        self.ready = False
        self._ready_event.clear()
        starting = not self._gen_ready
        if starting:
            self.start_failures += 1
        inflight = len(self.streams)
        self._fail_all("the engine process died; retry the request")
        if self.on_death:
            self.on_death()
        if code is not None and -code in STOP_SIGNALS and await self._stopping_within(SIGNAL_DEATH_WAIT_S):
            # An orderly stop (a supervisor signalling the whole group): said once, not as an error.
            log.info(
                "the engine was stopped by %s with this server (%d in-flight requests failed): not restarted",
                signal.Signals(-code).name,
                inflight,
            )
            return False
        log.error(
            "engine process died%s (exit code %s); failed %d in-flight requests",
            " while starting" if starting else "",
            code,
            inflight,
        )
        if self.start_failures >= START_ATTEMPTS:
            self._give_up(
                f"the engine process died {self.start_failures} times in a row before it was ready "
                f"(last exit code {code}); the log above says why"
            )
            return False
        self._close_sockets()
        if self.start_failures:
            pause = START_BACKOFF_S[min(self.start_failures, len(START_BACKOFF_S)) - 1]
            log.warning(
                "starting the engine again in %.0f s (try %d of %d)", pause, self.start_failures + 1, START_ATTEMPTS
            )
            await asyncio.sleep(pause)
        self.restarts += 1
        self.last_msg = time.monotonic()
        self._spawn()
        return True

    def expect_stop(self) -> None:
        """The server is stopping (its drain began): an engine that dies of SIGTERM or SIGINT from now
        on is not restarted (``SIGNAL_DEATH_WAIT_S``)."""
        self._stopping = True

    async def _stopping_within(self, wait_s: float) -> bool:
        """Whether the server's stop has begun, or begins within ``wait_s`` (``close`` also cancels the
        monitor waiting here, which ends its wait as well)."""
        end = time.monotonic() + wait_s
        while not (self._stopping or self._closing) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return self._stopping or self._closing

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
            end_process(self.proc)
        self._close_sockets()
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

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
