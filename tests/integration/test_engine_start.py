"""An engine that cannot be started: the front tries a few times, then gives up with one clear error
and exits 1 (never an endless restart loop); SIGTERM ends the server at once while the engine is
loading or failing to. Engines are killed from outside (SIGKILL) while they load, as the OOM killer
would; an engine that dies after serving still restarts (test_chaos.py, test_fault_tolerance.py)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import psutil
import pytest

from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Server

GRACE_S = 5.0


class EngineKiller:
    """A thread that SIGKILLs each engine process of the server ``proc`` as soon as it appears (long
    before its model is loaded), once ``armed``; it remembers every process the server ever had."""

    def __init__(self, proc: subprocess.Popen, armed: bool = True):
        self.front = psutil.Process(proc.pid)
        self.armed = threading.Event()
        if armed:
            self.armed.set()
        self.engines: list[int] = []  # every engine process seen, in order
        self.killed: list[int] = []
        self.seen: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                kids = self.front.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in kids:
                self.seen.setdefault(p.pid, p)
                try:
                    # The engine: the front's multiprocessing "spawn" child (not its resource tracker).
                    if p.ppid() != self.front.pid or "spawn_main" not in " ".join(p.cmdline()):
                        continue
                    if p.pid not in self.engines:
                        self.engines.append(p.pid)
                    if self.armed.is_set() and p.pid not in self.killed:
                        p.kill()
                        self.killed.append(p.pid)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.02)

    def wait_for(self, what: list[int], n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(what) < n:
            assert time.monotonic() < deadline, f"fewer than {n} engine processes in {timeout}s"
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def left_behind(self) -> list[int]:
        time.sleep(0.5)
        return [p.pid for p in self.seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _server(chat_model: str, tmp_path, name: str) -> Server:
    return Server(
        chat_model, *ENGINE_ARGS, "--log-level", "info", "--grace-period", str(GRACE_S),
        log_path=str(tmp_path / f"{name}.log"),
    )  # fmt: skip


def _exit_code(s: Server, killer: EngineKiller, timeout: float) -> int:
    try:
        return s.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit in {timeout}s:\n{s.logs()[-3000:]}")
    finally:
        killer.stop()
        s.stop()


def test_an_engine_that_keeps_dying_while_starting_is_given_up(chat_model, tmp_path):
    s = _server(chat_model, tmp_path, "dying")
    killer = EngineKiller(s.proc)
    rc = _exit_code(s, killer, timeout=120)
    logs = s.logs()
    assert rc == 1, logs[-3000:]
    assert len(killer.engines) == 3, (killer.engines, logs[-3000:])  # three tries, not a loop
    assert "starting the engine again in 1 s (try 2 of 3)" in logs
    assert "starting the engine again in 2 s (try 3 of 3)" in logs
    cause = "the engine cannot be started: the engine process died 3 times in a row before it was ready"
    assert logs.count(cause) == 1, logs[-3000:]
    assert "Traceback" not in logs and "Uvicorn running" not in logs, logs[-3000:]  # nothing served
    assert killer.left_behind() == []


def test_an_engine_that_keeps_dying_after_serving_is_given_up(chat_model, tmp_path):
    s = _server(chat_model, tmp_path, "serving")
    s.wait_healthy()
    killer = EngineKiller(s.proc)  # kills the serving engine (restarted at once), then each new one
    rc = _exit_code(s, killer, timeout=120)
    logs = s.logs()
    assert rc == 1, logs[-3000:]
    assert len(killer.engines) == 4, (killer.engines, logs[-3000:])
    assert logs.count("the engine cannot be started: the engine process died 3 times in a row") == 1
    assert killer.left_behind() == []


@pytest.mark.parametrize("engine", ["loading", "dying while starting", "restarting after serving"])
def test_sigterm_ends_the_server_whatever_the_engine_is_doing(chat_model, tmp_path, engine):
    s = _server(chat_model, tmp_path, engine.replace(" ", "_"))
    if engine == "restarting after serving":
        s.wait_healthy()
    killer = EngineKiller(s.proc, armed=engine != "loading")
    # SIGTERM while an engine is loading: the first one, or the one after a death (the first tries
    # of a start-up that keeps failing; a restart after the serving engine was killed).
    killer.wait_for(killer.engines, 2 if engine != "loading" else 1)
    s.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    rc = _exit_code(s, killer, timeout=60)
    took = time.monotonic() - t0
    logs = s.logs()
    assert rc == 0, logs[-3000:]
    assert took < GRACE_S, (took, logs[-3000:])
    if engine != "restarting after serving":
        assert "engine ready" not in logs, logs[-3000:]  # it did not wait for the model to load
        assert "start-up interrupted by a signal" in logs
    assert killer.left_behind() == []
