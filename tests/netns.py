"""Two "machines" on one box: two Linux network namespaces joined by a veth pair, each with its own
address (10.231.N.1 and 10.231.N.2), made by the test and deleted after it.

Processes run inside a namespace with ``ip netns exec``; the test talks to them from a thread that
joined the namespace (``setns``), so its sockets live there too. Nothing here touches the box's own
network: the veth pair is created and moved into the namespaces at once, and deleting a namespace
deletes its end.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

CLONE_NEWNET = 0x40000000
UNAVAILABLE = "network namespaces are not available here"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Host:
    """One namespace: its name, its address on the veth link, and a client thread inside it."""

    def __init__(self, name: str, addr: str):
        self.name, self.addr = name, addr
        self._pool = cf.ThreadPoolExecutor(max_workers=8, initializer=self._enter)  # each thread joins

    def _enter(self) -> None:  # in each of the pool's threads: setns is per thread
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.name}")
        finally:
            os.close(fd)

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` from inside this namespace (its sockets are made there)."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def get(self, url: str, **kw) -> httpx.Response:
        return self.call(httpx.get, url, timeout=kw.pop("timeout", 30), **kw)

    def post(self, url: str, **kw) -> httpx.Response:
        return self.call(httpx.post, url, timeout=kw.pop("timeout", 120), **kw)

    def popen(self, cmd: list[str], log_path: str) -> subprocess.Popen:
        log = open(log_path, "w")  # noqa: SIM115 - the process's; closed when the test's tmp dir goes
        return subprocess.Popen(
            ["ip", "netns", "exec", self.name, *cmd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def why_unavailable() -> str | None:
    """None where this process may make network namespaces (root, ``ip``, a kernel that allows it)."""
    if not sys.platform.startswith("linux") or shutil.which("ip") is None:
        return f"{UNAVAILABLE}: needs Linux and iproute2"
    if os.geteuid() != 0:
        return f"{UNAVAILABLE}: needs root"
    probe = f"kvlp{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"{UNAVAILABLE}: the kernel refused ({e.stderr.strip()})"
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("netns", "del", probe)
    return None


class TwoHosts:
    """``a`` and ``b``: two namespaces, a veth pair between them, loopback up in each."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}{int(time.monotonic() * 1000) % 100}"
        net = 1 + os.getpid() % 250
        self.names = (f"kvl{tag}a", f"kvl{tag}b")
        self.procs: list[subprocess.Popen] = []
        made: list[str] = []
        try:
            for n in self.names:
                _ip("netns", "add", n)
                made.append(n)
            va, vb = f"kv{tag}a", f"kv{tag}b"
            _ip("link", "add", va, "netns", self.names[0], "type", "veth", "peer", "name", vb, "netns", self.names[1])
            for n, v, last in ((self.names[0], va, 1), (self.names[1], vb, 2)):
                _ip("-n", n, "addr", "add", f"10.231.{net}.{last}/24", "dev", v)
                _ip("-n", n, "link", "set", v, "up")
                _ip("-n", n, "link", "set", "lo", "up")
        except BaseException:
            for n in made:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("netns", "del", n)
            raise
        self.a = Host(self.names[0], f"10.231.{net}.1")
        self.b = Host(self.names[1], f"10.231.{net}.2")

    def start(self, host: Host, cmd: list[str], log_path: str) -> subprocess.Popen:
        p = host.popen(cmd, log_path)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGINT)
        # The books were checked by the test; a process slow to stop (the router ignores SIGINT for
        # a while) is killed rather than waited for: CI's minutes matter more here.
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for h in (self.a, self.b):
            h.close()
        for n in self.names:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", n)
