"""What the front does when its engine process dies (``server/engine_client.py``), with a stand-in
process: an engine stopped by SIGTERM/SIGINT together with its server (a signal to the whole process
group, as a supervisor stopping ``kvledger serve --dp-size 2`` sends) is not restarted; a crash
(SIGKILL by the OOM killer, SIGSEGV, a nonzero exit) restarts as before, at once, even while the
server stops. Each case fails if the client restarts (or does not) where it should not (or should)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from kvledger.common import messages as m
from kvledger.config import EngineConfig
from kvledger.server import engine_client
from kvledger.server.engine_client import EngineClient


class DeadEngine:
    """A stand-in for the engine's process once it ended with ``exitcode``."""

    pid = 4242

    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass


class LiveEngine(DeadEngine):
    """A restarted engine that never dies (``close`` would terminate it)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.terminated = False

    def is_alive(self) -> bool:
        return not self.terminated

    def terminate(self) -> None:
        self.terminated = True

    kill = terminate


def _client(exitcode: int) -> tuple[EngineClient, list[int], asyncio.Queue]:
    """A client whose ready engine has just died with ``exitcode``, one request in flight; ``spawned``
    records each restart (no process is started)."""
    client = EngineClient(EngineConfig(), watchdog_timeout_s=None)
    spawned: list[int] = []

    def spawn() -> None:
        spawned.append(exitcode)
        client.proc = LiveEngine()

    client._spawn = spawn
    client.proc = DeadEngine(exitcode)
    client.generation, client._gen_ready, client.ready = 1, True, True
    q: asyncio.Queue = asyncio.Queue()
    client.streams["r1"] = q
    return client, spawned, q


def _in_flight_failed(q: asyncio.Queue) -> bool:
    out = q.get_nowait()
    return out.finished and out.finish_reason.status == 503


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_engine_stopped_by_a_signal_with_its_server_is_not_restarted(sig):
    async def run() -> list[int]:
        client, spawned, q = _client(-sig)
        client._tasks.append(asyncio.create_task(client._monitor()))
        await asyncio.sleep(0.3)  # the monitor saw the death; the front's own close comes after it
        assert _in_flight_failed(q)  # at once: the server's drain does not wait for a dead engine
        await client.close()
        await asyncio.sleep(0)
        return spawned

    assert asyncio.run(run()) == []


def test_an_engine_stopped_by_a_signal_while_the_server_drains_is_not_restarted(monkeypatch):
    monkeypatch.setattr(engine_client, "SIGNAL_DEATH_WAIT_S", 30.0)

    async def run() -> tuple[list[int], float]:
        client, spawned, q = _client(-signal.SIGTERM)
        client.expect_stop()  # the server's drain began (lifecycle.py)
        t0 = time.monotonic()
        await client._on_engine_death(client.proc.exitcode)  # returns at once: no wait for the close
        took = time.monotonic() - t0
        assert _in_flight_failed(q)
        await client.close()
        return spawned, took

    spawned, took = asyncio.run(run())
    assert spawned == [] and took < 5.0


def test_an_engine_stopped_by_a_signal_alone_is_restarted(monkeypatch):
    monkeypatch.setattr(engine_client, "SIGNAL_DEATH_WAIT_S", 0.3)

    async def run() -> list[int]:
        client, spawned, q = _client(-signal.SIGTERM)
        await client._on_engine_death(client.proc.exitcode)  # no close came: someone stopped the engine
        assert _in_flight_failed(q) and client.restarts == 1
        await client.close()
        return spawned

    assert asyncio.run(run()) == [-signal.SIGTERM]


@pytest.mark.parametrize("code", [-signal.SIGKILL, -signal.SIGSEGV, 1])
def test_a_crash_restarts_at_once_even_while_the_server_stops(monkeypatch, code):
    monkeypatch.setattr(engine_client, "SIGNAL_DEATH_WAIT_S", 30.0)

    async def run() -> tuple[list[int], float]:
        client, spawned, q = _client(code)
        client.expect_stop()
        t0 = time.monotonic()
        await client._on_engine_death(code)
        took = time.monotonic() - t0
        assert _in_flight_failed(q)
        await client.close()
        return spawned, took

    spawned, took = asyncio.run(run())
    assert spawned == [code] and took < 5.0


def test_a_ready_message_still_reaches_the_process_owner():
    """The channel hands the engine's Ready to the client (the split's seam)."""

    async def run() -> EngineClient:
        client, _, _ = _client(0)
        client.generation, client.ready = 1, False
        client._on_message(m.Ready(pid=7, info={"model": "x"}, limits={}, config={}))
        await client.close()
        return client

    client = asyncio.run(run())
    assert client.ready and client._gen_ready and client.info == {"model": "x"}
