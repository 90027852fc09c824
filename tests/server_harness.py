"""Start the real server (`python -m kvledger serve`) on loopback for integration tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range. A port from ``bind(0)`` is ephemeral:
    once the probe closes it, the next socket any process binds without a port (gloo's pairs, zmq's,
    a TP worker's) may take it before the server under test does (seen in CI: a PD bootstrap port
    taken while the TP group formed). Below the range only an explicit bind takes a port."""
    top = _ephemeral_floor()
    for _ in range(200):
        port = random.randrange(10000, max(10001, top))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def wait_idle(url: str, timeout: float = 10, headers: dict | None = None) -> tuple[dict, bool]:
    """Poll /get_server_info until the engine holds nothing for requests (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url + "/get_server_info", headers=headers or {}, timeout=10)
        r.raise_for_status()
        info = r.json()
        m = info["memory"]
        idle = (
            m["kv_private"] == 0
            and m["kv_cached_protected"] == 0
            and m["req_slots_free"] == m["req_slots_total"]
        )
        if idle or time.monotonic() > deadline:
            return info, idle
        time.sleep(0.05)


def books_balance(info: dict) -> bool:
    """Idle books: every page free, cached, held by a session or reserved (CUDA graphs' padding page),
    the sessions (all of them, whoever asks: ``session_counts``) hold what they say, and HiSparse
    holds nothing (no host page, no hot page)."""
    m = info["memory"]
    sparse_free = "hisparse" not in m or (m["hisparse"]["host_held"] == 0 and m["kv_hisparse_hot"] == 0)
    return (
        m["kv_free"] + m["kv_cached_evictable"] + m["kv_session"] + m.get("kv_reserved", 0) == m["kv_total"]
        and m["kv_session"] == info["session_counts"]["held_tokens"]  # every key's sessions, counted
        and sparse_free
    )


class Server:
    def __init__(self, model: str | None, *args: str, log_path: str, env: dict | None = None):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvledger", "serve", "--port", str(self.port), *args]
        if model:
            cmd += ["--model", model]
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.headers: dict[str, str] = {}

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.logs()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy in {timeout}s:\n{self.logs()[-3000:]}")

    def logs(self) -> str:
        if not self.log.closed:  # (still readable after stop())
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def info(self) -> dict:
        r = httpx.get(self.url + "/get_server_info", headers=self.headers, timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_idle_clean(self, timeout: float = 10) -> dict:
        """Every integration test ends here: once idle, no private pages, no protected cache, every
        slot free, the idle audit clean, and the engine never restarted behind our back."""
        info, idle = wait_idle(self.url, timeout, self.headers)
        m = info["memory"]
        assert idle, m
        assert books_balance(info), info
        assert m["leak_check"]["ok"], m
        assert info["session_counts"]["busy"] == 0, info["session_counts"]
        return info

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


class Router:
    """SGLang's router (``sglang-router``, a test dependency) as a subprocess on 127.0.0.1, with
    ``args`` (its workers and mode) and health checks every second; healthy when constructed."""

    def __init__(self, args: list[str], log_path: str, timeout: float = 60):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             *args, "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
             "--prometheus-port", str(free_port())],  # its exporter's default port would collide
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"the router did not start:\n{self.logs()[-3000:]}")
            time.sleep(0.2)

    def logs(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.log.close()


def gen(srv, body: dict, **kw) -> httpx.Response:
    """POST /generate on a started server."""
    return httpx.post(srv.url + "/generate", json=body, timeout=60, **kw)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); the front reaps its children, so look at the state too.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
