"""``kvledger serve --dp-size N``: N data-parallel replicas behind SGLang's router, one command.

Each replica is a whole ``kvledger serve`` process (its own engine, pools and books) on 127.0.0.1 at
``--port + 1 .. --port + N``. SGLang's router (``sglang-router``, the ``router`` extra) listens on
127.0.0.1 at ``--port + N + 1`` (its Prometheus exporter at ``--port + N + 2``, loopback too) with
``--router-policy`` (cache-aware by default) and health-checks
them; the session front (``dp_front.py``, a thread of this process) listens on ``--host:--port``: it
passes everything to the router except sessions, which the router cannot route (it keeps each
session's turns on the replica that opened it). The CPU's cores are shared out between the replicas
unless ``--num-threads`` says otherwise.

A replica that exits (a crash, a kill -9) is restarted with the same flags and port; the router marks
it down meanwhile and up again once its health checks pass (router 0.3.2 keeps the worker registered:
nothing to re-register). Each replica keeps its open sessions in its own ``--session-journal``
directory, so the restarted one re-opens them and their next turns recompute the KV, as after an
engine restart. A replica that keeps dying is restarted after a growing delay (up to 30 s).

SIGINT/SIGTERM stop the front and the router, then drain the replicas (each gets its
``--grace-period``); if the router or the front stops, the replicas are stopped too.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from ..config import ROUTER_POLICIES  # declared with --router-policy (config.LaunchSettings)
from ..errors import ValidationError
from .dp_front import DPFront
from .dp_http import FrontThread
from .middleware import CSRFMiddleware, parse_origins

log = logging.getLogger("kvledger.dp")



def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def check_dp(dp_size: int, port: int, policy: str) -> list[int]:
    """The replicas' ports, then the router's and its metrics exporter's, after the checks that need
    nothing started (a bad flag: exit 2)."""
    if dp_size < 2:
        raise ValidationError("--dp-size must be >= 2 to start replicas", param="dp_size")
    if policy not in ROUTER_POLICIES:
        raise ValidationError(f"--router-policy must be one of {ROUTER_POLICIES}", param="router_policy")
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise ValidationError(
            "--dp-size runs SGLang's router: pip install 'kvledger[router]' (sglang-router)",
            param="dp_size",
        ) from None
    # the replicas, the router, and the router's Prometheus exporter (loopback: by default it would
    # listen on 0.0.0.0:29000, open to the network and taken by a second launcher on the same host)
    ports = [port + 1 + i for i in range(dp_size + 2)]
    busy = [p for p in ports if not port_free(p)]
    if busy:
        raise ValidationError(f"--dp-size {dp_size} needs ports {ports}; in use: {busy}", param="port")
    return ports


def _replica_argv(argv: list[str], port: int, threads: int | None, journal: str) -> list[str]:
    # argparse keeps the last value of a repeated flag: the replica's own settings go last.
    extra = ["--host", "127.0.0.1", "--port", str(port), "--dp-size", "1", "--session-journal", journal]
    if threads is not None:
        extra += ["--num-threads", str(threads)]
    return [sys.executable, "-m", "kvledger", "serve", *argv, *extra]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_healthy(procs: list[subprocess.Popen], urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        for p, url in zip(procs, urls):
            if p.poll() is not None:
                raise RuntimeError(f"replica {url} exited with {p.returncode} while starting")
            if url in pending and _healthy(url):
                pending.discard(url)
                log.info("replica %s is healthy", url)
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas not healthy in {timeout:.0f}s: {sorted(pending)}")
        time.sleep(0.3)


def _wait_router(proc: subprocess.Popen, url: str, api_key: str | None, timeout: float = 120) -> None:
    """Until the router lists the replicas' model (its workers are registered): the public port
    opens only once the whole deployment can serve."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode} while starting")
        try:
            r = httpx.get(url + "/v1/models", timeout=1, headers=headers)
            if r.status_code == 200 and r.json().get("data"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the router did not register the replicas in {timeout:.0f}s")


def _stop(procs: list[subprocess.Popen], sig: int, timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Replica:
    """One replica process and its restarts."""

    MAX_DELAY_S = 30.0

    def __init__(self, index: int, argv: list[str], url: str):
        self.index, self.argv, self.url = index, argv, url
        self.proc = subprocess.Popen(argv)
        self.started = time.monotonic()
        self.delay = 0.0  # before the next restart; grows while it keeps dying young
        self.restart_at: float | None = None
        self.restarts = 0

    def tend(self, up: list[bool]) -> None:
        """Restart it if it exited; mark it up once a (re)started one answers /health."""
        now = time.monotonic()
        if self.proc.poll() is not None:
            if self.restart_at is None:
                up[self.index] = False
                young = now - self.started < 60
                self.delay = min(self.MAX_DELAY_S, max(1.0, 2 * self.delay)) if young else 0.0
                self.restart_at = now + self.delay
                log.error("dp: replica %d (%s) exited with %s; restarting it in %.0f s",
                          self.index, self.url, self.proc.returncode, self.delay)  # fmt: skip
            if now >= self.restart_at:
                self.proc = subprocess.Popen(self.argv)
                self.started, self.restart_at = now, None
                self.restarts += 1
        elif not up[self.index] and _healthy(self.url):
            up[self.index] = True
            log.warning("dp: replica %d (%s) is serving again (restart %d)", self.index, self.url, self.restarts)


def serve_dp(
    argv: list[str],
    host: str,
    port: int,
    dp_size: int,
    policy: str,
    num_threads: int | None,
    api_key: list[str] | None,
    grace_period_s: float,
    session_journal: str | None = None,
    max_body_bytes: int = 8 * 1024 * 1024,
    max_sessions: int = 64,
    body_timeout_s: float = 30.0,
    allowed_origins: list[str] | None = None,
) -> int:
    """Start the replicas, the router and the front; tend the replicas until a signal; stop them all
    (exit status). ``session_journal`` is the directory under which each replica keeps its sessions
    (a temporary one, removed at the end, by default)."""
    *ports, router_port, router_metrics_port = check_dp(dp_size, port, policy)
    if num_threads is None:
        # The cores this process may run on (its affinity, not the machine's), shared out: replicas
        # that oversubscribe them stall each other's compute threads. Not pinned to cores: beside
        # another busy process the OS must stay free to move a replica to whichever core is free.
        num_threads = max(1, len(os.sched_getaffinity(0)) // dp_size)
    journals = session_journal or tempfile.mkdtemp(prefix="kvledger-dp-sessions-")
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas = [
        Replica(i, _replica_argv(argv, p, num_threads, os.path.join(journals, f"replica-{i}")), url)
        for i, (p, url) in enumerate(zip(ports, urls))
    ]
    up = [False] * dp_size
    router: subprocess.Popen | None = None
    front: FrontThread | None = None
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        log.info("dp: starting %d replicas on %s (%d threads each)", dp_size, ", ".join(urls), num_threads)
        _wait_healthy([r.proc for r in replicas], urls, timeout=600)
        up[:] = [True] * dp_size
        router_url = f"http://127.0.0.1:{router_port}"
        router = _start_router(router_port, router_metrics_port, urls, policy, api_key)
        _wait_router(router, router_url, api_key)  # (assigned first: the finally stops it if it never answers)
        # The front is the public origin: it refuses cross-site requests itself (the replicas see the
        # front's address as Host, so it drops Origin once checked).
        dp = DPFront(router_url, urls, up, max_body_bytes, max_sessions, body_timeout_s)
        front = FrontThread(CSRFMiddleware(dp, parse_origins(allowed_origins)), host, port)
        front.start()
        log.info("dp: serving on http://%s:%d (SGLang's router, %s, on %s; sessions kept on their replica)",
                 host, port, policy, router_url)  # fmt: skip
        while not stopping:
            if not _tend(router, front, replicas, up):
                return 1
            time.sleep(0.3)
        return 0
    except RuntimeError as e:
        log.error("dp: %s", e)
        return 1
    finally:
        if front is not None:
            front.stop()
        if router is not None:
            _stop([router], signal.SIGTERM, 10)
        _stop([r.proc for r in replicas], signal.SIGINT, grace_period_s + 30)
        if session_journal is None:
            shutil.rmtree(journals, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


def _start_router(
    router_port: int, metrics_port: int, urls: list[str], policy: str, api_key: list[str] | None
) -> subprocess.Popen:
    """SGLang's router over the replicas, on loopback, its Prometheus exporter too (started; the
    caller waits for it to answer)."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(router_port), "--worker-urls", *urls, "--policy", policy,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1"]  # fmt: skip
    if api_key:  # the key of the router's own calls to the replicas (health, loads, flush)
        cmd += ["--api-key", api_key[0]]
    return subprocess.Popen(cmd)


def _tend(router: subprocess.Popen, front: FrontThread, replicas: list[Replica], up: list[bool]) -> bool:
    """One look at the router, the front and the replicas (restarting a replica that died); False when
    the router or the front has stopped (the launcher then stops everything)."""
    if router.poll() is not None:
        log.error("dp: the router exited with %s; stopping the replicas", router.returncode)
        return False
    if not front.alive():
        log.error("dp: the front stopped; stopping the replicas")
        return False
    for r in replicas:
        r.tend(up)
    return True
