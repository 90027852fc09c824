"""``kvledger serve --tp-size 2`` as a user runs it: it serves; killing a worker rank takes the engine
group down and the restart path brings a new one up (the front stays up, /health 503 meanwhile);
two "nodes" (processes on 127.0.0.1) serve as one; shutdown leaves no process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Server, free_port, process_alive

BODY = {
    "input_ids": [5, 6, 7, 8],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
}


def test_serve_tp2_survives_a_dead_worker(chat_model, tmp_path):
    s = Server(
        chat_model,
        *ENGINE_ARGS,
        "--tp-size",
        "2",
        "--watchdog-timeout",
        "3",
        log_path=str(tmp_path / "tp.log"),
    )
    pids: list[int] = []
    try:
        s.wait_healthy()
        first = httpx.post(s.url + "/generate", json=BODY, timeout=60).json()["output_ids"]
        # The usual clients work as on one rank: OpenAI chat (streamed too) and a session.
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        full = c.chat.completions.create(model="default", messages=msgs, max_tokens=8, temperature=0)
        parts = c.chat.completions.create(
            model="default", messages=msgs, max_tokens=8, temperature=0, stream=True
        )
        assert (
            "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
            == full.choices[0].message.content
        )
        sid = httpx.post(s.url + "/open_session", json={}).json()
        turn = {**BODY, "session_params": {"id": sid}}
        assert httpx.post(s.url + "/generate", json=turn, timeout=60).status_code == 200
        assert httpx.post(s.url + "/close_session", json={"session_id": sid}).status_code == 200
        info = s.info()
        assert info["engine"]["tp_size"] == 2
        [worker] = info["engine"]["tp_worker_pids"]
        pids += [worker, info["engine_pid"]]
        os.kill(worker, signal.SIGKILL)
        # The next step finds the rank gone: the engine ends, the front restarts the whole group.
        r = httpx.post(s.url + "/generate", json=BODY, timeout=60)
        assert r.status_code == 503, r.text
        s.wait_healthy(timeout=120)
        info = s.info()
        assert info["engine_restarts"] == 1 and info["engine"]["tp_worker_pids"] != [worker]
        pids += [*info["engine"]["tp_worker_pids"], info["engine_pid"]]
        again = httpx.post(s.url + "/generate", json=BODY, timeout=60).json()["output_ids"]
        assert again == first
        # A rank that hangs stalls the step; the watchdog ends the engine and the group comes back.
        [worker] = info["engine"]["tp_worker_pids"]
        os.kill(worker, signal.SIGSTOP)
        r = httpx.post(s.url + "/generate", json=BODY, timeout=60)
        assert r.status_code == 503, r.text
        s.wait_healthy(timeout=120)
        info = s.info()
        assert info["engine_restarts"] == 2
        pids += [*info["engine"]["tp_worker_pids"], info["engine_pid"]]
        assert httpx.post(s.url + "/generate", json=BODY, timeout=60).json()["output_ids"] == first
        s.wait_idle_clean()
    finally:
        assert s.stop() == 0
    time.sleep(0.5)
    assert not any(process_alive(p) for p in pids), s.logs()[-2000:]


def test_two_nodes_on_loopback(chat_model, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    key = tmp_path / "tp.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    multi = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--dist-auth-key-file", str(key)]
    node1_log = open(tmp_path / "node1.log", "w")  # noqa: SIM115 - closed below
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvledger",
            "serve",
            "--model",
            chat_model,
            *ENGINE_ARGS,
            *multi,
            "--node-rank",
            "1",
        ],
        stdout=node1_log,
        stderr=subprocess.STDOUT,
    )
    s = Server(chat_model, *ENGINE_ARGS, *multi, "--node-rank", "0", log_path=str(tmp_path / "node0.log"))
    try:
        s.wait_healthy()
        info = s.info()
        assert info["engine"]["tp_size"] == 2 and info["engine"]["tp_worker_pids"] == []  # rank 1 is node 1's
        r = httpx.post(s.url + "/generate", json=BODY, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 6
        s.wait_idle_clean()
    finally:
        assert s.stop() == 0
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(timeout=30) == 0
        node1_log.close()
