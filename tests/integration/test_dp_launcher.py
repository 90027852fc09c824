"""``kvledger serve --dp-size 2``: one command starts two replicas and SGLang's router in front.
Requests through the router reach both replicas; a replica killed with SIGKILL is marked down by the
router, which keeps serving on the other; SIGINT stops everything, no process left behind; the
surviving replica's books are clean."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Server, free_port

pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")


def served(url: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvledger_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the launcher exited with {proc.returncode}"
        try:
            # The router is up once its workers are registered: a model list names them.
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the router did not come up")


def test_dp_size_starts_replicas_behind_the_router(chat_model, tmp_path):
    port = free_port()
    log = open(tmp_path / "dp.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger", "serve", "--model", chat_model, *ENGINE_ARGS, "--port", str(port),
         "--dp-size", "2", "--router-policy", "round_robin", "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{port + 1 + i}" for i in range(2)]
    children: list[psutil.Process] = []
    try:
        wait_up(url, proc)
        # Every process of the deployment (router, replica fronts, their engines), the killed one's too.
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5, children
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for i in range(6):
            r = c.completions.create(
                model="default", prompt=f"item {i} " * (i + 1), max_tokens=3, temperature=0
            )
            assert r.choices[0].text is not None
        gained = [served(u) for u in replicas]
        assert sum(gained) >= 6 and min(gained) > 0, gained
        # The router's Prometheus exporter is this deployment's (--port + N + 2) and on loopback only:
        # by default it takes 0.0.0.0:29000, open to the network, and a second launcher's router dies.
        metrics = httpx.get(f"http://127.0.0.1:{port + 4}/metrics", timeout=10)
        assert metrics.status_code == 200 and "# TYPE" in metrics.text, metrics.text[:200]
        pids = {proc.pid} | {ch.pid for ch in children}
        listens = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids
        }
        assert ("127.0.0.1", port + 4) in listens, listens
        assert all(ip == "127.0.0.1" for ip, p in listens if p != port), listens  # only the front on --host
        # Kill one replica outright: the router marks it down and serves on with the other.
        victim = httpx.get(replicas[0] + "/get_server_info", timeout=10).json()["server_pid"]
        os.kill(victim, signal.SIGKILL)
        ok, deadline = 0, time.monotonic() + 60
        while ok < 5:
            assert time.monotonic() < deadline, "the router kept sending to the dead replica"
            try:
                r = httpx.post(
                    url + "/generate",
                    json={"text": "still there?", "sampling_params": {"max_new_tokens": 2}},
                    timeout=30,
                )
                ok = ok + 1 if r.status_code == 200 else 0
            except httpx.HTTPError:
                ok = 0
            time.sleep(0.2)
        srv = Server.__new__(Server)  # the harness's checks of a server it did not start: a url
        srv.url, srv.headers = replicas[1], {}
        srv.wait_idle_clean()
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=90)
        log.close()
    assert rc == 0, (tmp_path / "dp.log").read_text()[-3000:]
    time.sleep(0.5)
    left = [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    # (the killed replica's engine included: it dies with its front, PR_SET_PDEATHSIG)
    assert left == [], f"processes left behind: {left}"
