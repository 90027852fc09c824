"""The engine process started first: ``kvledger serve`` spawns it as soon as its settings' values
are checked, before the front imports torch (the settings' device and disk checks), FastAPI, the
routes and transformers (the tokenizer), so that the engine's own imports and model load run beside
the front's instead of after them (~2 s of a warm start here; docs/architecture.md, "Start-up").

The process is an ordinary generation 1 of ``EngineClient``: the client adopts it (``early=``) and
binds its sockets when the event loop runs; the engine connects first and ZMQ delivers what it sent
once the front binds. Until uvicorn installs its own handlers, SIGTERM/SIGINT stop the start-up at
once (``StartInterrupted``): the engine is terminated, nothing is served, exit 0, as a signal during
the engine's load does later in the start."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from ..config import EngineConfig

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartInterrupted(BaseException):
    """SIGTERM/SIGINT before the HTTP server took the signals over (a ``BaseException``, like
    ``KeyboardInterrupt``: no ``except Exception`` of the start-up swallows it)."""


def run_engine(cfg: dict, ipc_dir: str, generation: int, log_level: str) -> None:
    """The spawned process's target: the engine's modules (torch ...) are imported there, never in
    the front (``engine_main``, ``launch/process.py``)."""
    from ..common.quick_exit import exit_now
    from ..launch.process import engine_main

    engine_main(cfg, ipc_dir, generation, log_level)
    exit_now(0)  # what multiprocessing's exit does, minus torch's teardown (common/quick_exit.py)


def spawn_engine(cfg: EngineConfig, ipc_dir: str, generation: int, log_level: str) -> BaseProcess:
    """Start one engine process (multiprocessing "spawn": a fresh interpreter, no state of the
    front's inherited); it connects to ``ipc_dir``'s sockets of ``generation``."""
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine,
        args=(cfg.flat(), ipc_dir, generation, log_level),
        daemon=True,
        name=f"kvledger-engine-{generation}",
    )
    proc.start()
    return proc


def private_ipc_dir() -> str:
    """A directory only this user may open: the engine's sockets live there."""
    d = tempfile.mkdtemp(prefix="kvledger-")
    os.chmod(d, 0o700)
    return d


@dataclass
class EarlyEngine:
    """An engine process (generation 1) started before the front's HTTP server exists, and the
    signal handlers that stop the start-up until ``disarm``."""

    ipc_dir: str
    proc: BaseProcess
    _saved: dict = field(default_factory=dict)

    @classmethod
    def start(cls, cfg: EngineConfig, log_level: str) -> EarlyEngine:
        ipc_dir = private_ipc_dir()
        early = cls(ipc_dir, spawn_engine(cfg, ipc_dir, 1, log_level))
        for sig in _SIGNALS:
            early._saved[sig] = signal.signal(sig, _interrupt)
        return early

    def disarm(self) -> None:
        """Give the signals back to their handlers of before (uvicorn then installs its own)."""
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def stop(self) -> None:
        """A start-up that ends before the client adopted the process: terminate it, remove its
        directory."""
        self.disarm()
        end_process(self.proc)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def end_process(proc: BaseProcess, timeout: float = 3.0) -> None:
    """SIGTERM ``proc`` if alive, then SIGKILL if it outlives ``timeout`` seconds; joined either way."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=timeout)


def _interrupt(signum, frame) -> None:
    raise StartInterrupted(signal.Signals(signum).name)
