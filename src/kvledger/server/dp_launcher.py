"""``kvledger serve --dp-size N``: N data-parallel replicas behind SGLang's router, one command.

Each replica is a whole ``kvledger serve`` process (its own engine, pools and books) on 127.0.0.1 at
``--port + 1 .. --port + N``; SGLang's router (``sglang-router``, the ``router`` extra) listens on
``--host:--port`` with ``--router-policy`` (cache-aware by default) and health-checks them. The CPU's
cores are shared out between the replicas unless ``--num-threads`` says otherwise. SIGINT/SIGTERM stop
the router, then drain the replicas (each gets its ``--grace-period``); if the router exits, the
replicas are stopped too. A replica that dies is marked down by the router, which serves on with the
others; it is not restarted here (its own engine restarts within it as usual).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from ..errors import ValidationError

log = logging.getLogger("kvledger.dp")

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def check_dp(dp_size: int, port: int, policy: str) -> list[int]:
    """The replicas' ports, after the checks that need nothing started (a bad flag: exit 2)."""
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
    ports = [port + 1 + i for i in range(dp_size)]
    busy = [p for p in ports if not _port_free(p)]
    if busy:
        raise ValidationError(f"--dp-size {dp_size} needs ports {ports}; in use: {busy}", param="port")
    return ports


def _replica_argv(argv: list[str], port: int, threads: int | None) -> list[str]:
    # argparse keeps the last value of a repeated flag: the replica's own settings go last.
    extra = ["--host", "127.0.0.1", "--port", str(port), "--dp-size", "1"]
    if threads is not None:
        extra += ["--num-threads", str(threads)]
    return [sys.executable, "-m", "kvledger", "serve", *argv, *extra]


def _wait_healthy(procs: list[subprocess.Popen], urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        for p, url in zip(procs, urls):
            if p.poll() is not None:
                raise RuntimeError(f"replica {url} exited with {p.returncode} while starting")
            if url in pending:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        pending.discard(url)
                        log.info("replica %s is healthy", url)
                except httpx.HTTPError:
                    pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas not healthy in {timeout:.0f}s: {sorted(pending)}")
        time.sleep(0.3)


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


def serve_dp(
    argv: list[str],
    host: str,
    port: int,
    dp_size: int,
    policy: str,
    num_threads: int | None,
    api_key: str | None,
    grace_period_s: float,
) -> int:
    """Start the replicas and the router; return when they have stopped (exit status)."""
    ports = check_dp(dp_size, port, policy)
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // dp_size)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas = [subprocess.Popen(_replica_argv(argv, p, num_threads)) for p in ports]
    router: subprocess.Popen | None = None
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        log.info("dp: starting %d replicas on %s (%d threads each)", dp_size, ", ".join(urls), num_threads)
        _wait_healthy(replicas, urls, timeout=600)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
               "--worker-urls", *urls, "--policy", policy, "--worker-startup-check-interval", "1",
               "--health-check-interval-secs", "1"]  # fmt: skip
        if api_key:
            cmd += ["--api-key", api_key]
        router = subprocess.Popen(cmd)
        log.info("dp: SGLang's router (%s) on http://%s:%d", policy, host, port)
        while not stopping:
            if router.poll() is not None:
                log.error("dp: the router exited with %s; stopping the replicas", router.returncode)
                return 1
            time.sleep(0.5)
        return 0
    except RuntimeError as e:
        log.error("dp: %s", e)
        return 1
    finally:
        if router is not None:
            _stop([router], signal.SIGTERM, 10)
        _stop(replicas, signal.SIGINT, grace_period_s + 30)
        for s, h in old.items():
            signal.signal(s, h)
