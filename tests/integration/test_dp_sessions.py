"""Sessions through the one URL of ``kvledger serve --dp-size 2`` (SGLang's router behind the session
front): every turn lands on the replica that holds the session's KV (cached tokens on every later
turn) and greedy fp32 output equals one plain server's; two sessions each stay on their holder; an
unknown session is a 404 in the OpenAI shape; a replica killed with SIGKILL is restarted by the
launcher and its session goes on (the next turn recomputes, the one after is cached again). Every
replica's books are clean at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvledger.server.dp_launcher import port_free
from tests import openai_suite
from tests.integration.conftest import ENGINE_ARGS
from tests.nulls import walk
from tests.server_harness import Server, free_port

pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")

THREADS = ["--num-threads", "1"]  # the replicas' share of 2 cores; the reference server runs the same


class DP:
    """The launcher as a user starts it, and its replicas (ports --port+1, --port+2)."""

    def __init__(self, model: str, log_path: str):
        self.port = free_port()
        while not all(port_free(self.port + i) for i in (1, 2, 3)):
            self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.replicas = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(2)]
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvledger", "serve", "--model", model, *ENGINE_ARGS, *THREADS,
             "--port", str(self.port), "--dp-size", "2", "--log-level", "info",
             # Round robin: the router alone would send a session's turns to both replicas, so a turn
             # that meets its KV every time is the front's doing, never the luck of a cache-aware pick.
             "--router-policy", "round_robin"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def wait_up(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.logs()[-3000:]
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.logs()[-3000:])

    def logs(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def holders(self, sid: str) -> list[int]:
        """The replicas whose engine has session ``sid`` open."""
        return [
            i for i, u in enumerate(self.replicas)
            if any(s["id"] == sid for s in httpx.get(u + "/get_server_info", timeout=10).json()["sessions"])
        ]  # fmt: skip

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=90)
        finally:
            self.log.close()



def _clean(url: str) -> dict:
    """The harness's idle-and-clean checks on a server it did not start (a replica's url); its info."""
    srv = Server.__new__(Server)
    srv.url, srv.headers = url, {}
    return srv.wait_idle_clean()


def running_dp(model: str, log_path: str):
    """A fixture's body: ``DP`` of ``model`` up; stopped after, exiting 0."""
    d = DP(model, log_path)
    try:
        d.wait_up()
        yield d
    finally:
        rc = d.stop()
    assert rc == 0, d.logs()[-3000:]


@pytest.fixture(scope="module")
def dp(chat_model, tmp_path_factory):
    yield from running_dp(chat_model, str(tmp_path_factory.mktemp("dp") / "dp.log"))


@pytest.fixture(scope="module")
def plain(chat_model, tmp_path_factory):
    s = Server(chat_model, *ENGINE_ARGS, *THREADS, log_path=str(tmp_path_factory.mktemp("plain") / "s.log"))
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def turn_text(k: int) -> str:
    return f"Turn {k}: tell me about the weather on the coast today. " * 2


def open_session(url: str) -> str:
    r = httpx.post(url + "/open_session", json={}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def turn(url: str, sid: str, k: int, timeout: float = 60) -> dict:
    """One session turn; a 503 (the holder restarting) is retried until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(url + "/generate", timeout=60, json={
            "text": turn_text(k), "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        })  # fmt: skip
        if r.status_code != 503 or time.monotonic() > deadline:
            break
        assert r.json()["error"]["type"] == "service_unavailable" and r.headers["retry-after"], r.text
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    return r.json()


def close_session(url: str, sid: str) -> None:
    r = httpx.post(url + "/close_session", json={"session_id": sid}, timeout=30)
    assert r.status_code == 200, r.text


def reference(plain: Server, turns: int | list[int]) -> list[list[int]]:
    """The same session's turns (``turn_text(k)`` for each k) on one plain server."""
    sid = open_session(plain.url)
    out = [turn(plain.url, sid, k)["output_ids"] for k in (range(turns) if isinstance(turns, int) else turns)]
    close_session(plain.url, sid)
    return out


def test_the_openai_client_suite_and_every_null_field_through_the_one_url(dp):
    """Issue 56: a body the single server accepts is accepted the same way behind the front (the
    router refused null fields and bodies without a model, and did not serve score, rerank,
    tokenize, detokenize or a stored response's follow-ups, retrieve, delete and cancel)."""
    openai_suite.run(dp.url)
    assert walk(dp.url) == []
    for url in dp.replicas:
        _clean(url)


def test_session_turns_through_the_one_url_meet_their_kv(dp, plain):
    ref = reference(plain, 4)
    sid = open_session(dp.url)
    [holder] = dp.holders(sid)
    outs = [turn(dp.url, sid, k) for k in range(4)]
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert all(c > 0 for c in cached[1:]), cached  # every later turn found the session's KV
    assert [o["output_ids"] for o in outs] == ref
    assert dp.holders(sid) == [holder]
    close_session(dp.url, sid)
    assert dp.holders(sid) == []
    for u in dp.replicas:
        _clean(u)


def test_two_sessions_each_stay_on_their_holder(dp, plain):
    ref = reference(plain, 3)
    sids = [open_session(dp.url) for _ in range(2)]
    holders = [dp.holders(s) for s in sids]
    assert all(len(h) == 1 for h in holders), holders  # on different replicas or the same: one each
    outs = {s: [] for s in sids}
    for k in range(3):  # interleaved
        for s in sids:
            outs[s].append(turn(dp.url, s, k))
    for s, h in zip(sids, holders):
        assert [o["meta_info"]["cached_tokens"] > 0 for o in outs[s]] == [False, True, True], outs[s]
        assert [o["output_ids"] for o in outs[s]] == ref
        assert dp.holders(s) == h
        close_session(dp.url, s)
    for u in dp.replicas:
        _clean(u)


def test_a_streamed_turn_whose_client_leaves_ends_on_its_replica(dp, plain):
    """The front closes the upstream request when its client goes: the replica aborts the turn (which
    leaves the session as it was) instead of generating 800 tokens for nobody."""
    ref = reference(plain, [0, 2])
    sid = open_session(dp.url)
    first = turn(dp.url, sid, 0)
    body = {"text": turn_text(1), "session_params": {"id": sid}, "stream": True,
            "sampling_params": {"max_new_tokens": 800, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    with httpx.stream("POST", dp.url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(ln for ln in r.iter_lines() if ln.startswith("data:"))
    t0 = time.monotonic()
    while True:  # the session is busy (409) only until the replica has seen the disconnect
        r = httpx.post(dp.url + "/generate", timeout=60, json={
            "text": turn_text(2), "session_params": {"id": sid},
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        })  # fmt: skip
        if r.status_code != 409 or time.monotonic() - t0 > 3:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    assert [first["output_ids"], r.json()["output_ids"]] == ref  # the left turn added nothing
    assert r.json()["meta_info"]["cached_tokens"] > 0
    close_session(dp.url, sid)
    for u in dp.replicas:
        _clean(u)


def test_bad_session_requests_get_the_api_s_4xx_through_the_one_url(dp):
    for path, body in (
        ("/generate", {"text": "hi", "session_params": {"id": "no-such-session"}}),
        ("/close_session", {"session_id": "no-such-session"}),
    ):
        r = httpx.post(dp.url + path, json=body, timeout=30)
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "session_not_found", err
    # Malformed session bodies are the replicas' own 400s, through the one URL.
    r = httpx.post(dp.url + "/close_session", json={"session": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    # A client-chosen id twice: its holder says 409, no second replica opens it.
    assert httpx.post(dp.url + "/open_session", json={"session_id": "mine"}, timeout=30).json() == "mine"
    r = httpx.post(dp.url + "/open_session", json={"session_id": "mine"}, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error", r.text
    assert len(dp.holders("mine")) == 1
    close_session(dp.url, "mine")
    # Every replica's session table full (--max-sessions 8 each): 429 from the last one asked.
    sids = [open_session(dp.url) for _ in range(16)]
    assert sorted(len(dp.holders(s)) for s in sids) == [1] * 16
    r = httpx.post(dp.url + "/open_session", json={}, timeout=30)
    assert r.status_code == 429 and r.json()["error"]["type"] == "overloaded_error", r.text
    for s in sids:
        close_session(dp.url, s)
    for u in dp.replicas:
        _clean(u)


def test_a_killed_replica_is_restarted_and_its_session_goes_on(dp, plain):
    ref = reference(plain, 4)
    sid = open_session(dp.url)
    [holder] = dp.holders(sid)
    first = [turn(dp.url, sid, k) for k in range(2)]
    assert first[1]["meta_info"]["cached_tokens"] > 0
    url = dp.replicas[holder]
    pid = httpx.get(url + "/get_server_info", timeout=10).json()["server_pid"]
    os.kill(pid, signal.SIGKILL)  # mid-idle: the session holds KV, no turn runs
    # Its next turn waits (503, retried) for the launcher to bring the replica back.
    third = turn(dp.url, sid, 2, timeout=240)
    assert httpx.get(url + "/get_server_info", timeout=10).json()["server_pid"] != pid
    assert "exited with -9; restarting it" in dp.logs()
    assert dp.holders(sid) == [holder]  # re-opened there from its journal
    assert third["meta_info"]["cached_tokens"] == 0  # its KV died with the process: recomputed
    fourth = turn(dp.url, sid, 3)
    assert fourth["meta_info"]["cached_tokens"] > 0
    assert [o["output_ids"] for o in [*first, third, fourth]] == ref
    close_session(dp.url, sid)
    # Plain requests through the router are served after the restart too.
    for i in range(4):
        r = httpx.post(dp.url + "/v1/completions", timeout=60,
                       json={"model": "default", "prompt": f"after {i}", "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200, r.text
    for u in dp.replicas:
        _clean(u)
