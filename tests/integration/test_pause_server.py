"""Pause, continue and hot weight reload on the real server (issue 33 item 6), as RL trainers drive
them: ``/pause_generation`` {mode: abort | retract | in_place}, ``/continue_generation``,
``/update_weights_from_disk`` {model_path}, all under the admin key.

fp32 greedy on the tiny chat model: a request retract-paused mid-stream and continued streams its
uninterrupted output; paused in place it stalls holding its KV and resumes; a pause with mode abort
ends what runs with finish_reason abort; requests that arrive while paused wait and run after the
continue. A weight update answers what a fresh server on the new weights answers, with the prefix
cache empty and a session's next turn recomputed; a bad path or other shapes is a 400 with the old
weights still answering. Every test ends with the books clean and generation not paused.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.helpers import build_tiny_chat_model, build_tiny_model
from tests.integration.conftest import ENGINE_ARGS, started_server
from tests.server_harness import Server

USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}
PROMPT = [7, 8, 9, 10, 11] * 3
P40 = list(range(20, 60))  # over two pages of 16: a repeat is served from the prefix cache
LONG = 120  # tokens: with 10 ms a step, over a second in which to pause it mid-generation


@pytest.fixture(scope="module")
def keyed(chat_model, tmp_path_factory):
    """Keys set, and every forward at least 10 ms (``testing/faults.py``): a pause sent after the
    first tokens lands mid-generation however fast the machine is."""
    log = str(tmp_path_factory.mktemp("logs") / "pause.log")
    keys = ("--api-key", "user-key", "--admin-api-key", "admin-key")
    s = Server(chat_model, *ENGINE_ARGS, *keys, log_path=log, env={"KVLEDGER_TEST_STEP_DELAY_S": "0.01"})
    s.headers = ADMIN
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture
def ps(keyed):
    """The keyed server; each test ends with generation running and the books clean."""
    restarts = keyed.info()["engine_restarts"]
    yield keyed
    info = keyed.wait_idle_clean()
    assert info["generation_paused"] is None
    assert info["engine_restarts"] == restarts, keyed.logs()[-2000:]


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory) -> str:
    """The chat model's architecture and tokenizer with other random weights."""
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny_chat_new")), seed=6)


def post(srv, path: str, body=None, headers=ADMIN, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=300, **kw)


def generate(srv, ids, n, **extra) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = post(srv, "/generate", {**body, **extra}, USER)
    assert r.status_code == 200, r.text
    return r.json()


class Stream:
    """A streamed /generate read on a thread: every event's output_ids, as they arrive."""

    def __init__(self, srv, ids, n: int):
        self.events: list[dict] = []
        body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        self.thread = threading.Thread(target=self._read, args=(srv, body), daemon=True)
        self.thread.start()

    def _read(self, srv, body) -> None:
        with httpx.stream("POST", srv.url + "/generate", json=body, headers=USER, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.events.append(json.loads(line[6:]))

    @property
    def tokens(self) -> int:
        return len(self.events[-1]["output_ids"]) if self.events else 0

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 300
        while self.tokens < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), self.events[-1:]
            time.sleep(0.002)

    def final(self) -> dict:
        self.thread.join(300)
        assert not self.thread.is_alive()
        return self.events[-1]


def test_retract_pause_mid_generation_then_continue_is_token_exact(ps):
    want = generate(ps, PROMPT, LONG)["output_ids"]
    s = Stream(ps, PROMPT, LONG)
    s.wait_tokens(10)
    r = post(ps, "/pause_generation", {"mode": "retract"})
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert r.json()["num_paused_requests"] == 1  # it was mid-generation: the engine holds it
    info = ps.info()
    m = info["memory"]
    assert info["generation_paused"] == "retract"
    # Retracted: no slot, no private page; its KV went to the prefix cache.
    assert m["req_slots_free"] == m["req_slots_total"] and m["kv_private"] == 0, m
    assert m["kv_cached_evictable"] > 0, m
    n = s.tokens
    time.sleep(0.5)
    assert s.tokens == n < LONG  # nothing generated while paused
    assert post(ps, "/continue_generation").status_code == 200
    final = s.final()
    assert final["output_ids"] == want
    assert final["meta_info"]["finish_reason"]["type"] == "length"


def test_in_place_pause_stalls_holding_kv_and_resumes(ps):
    want = generate(ps, PROMPT, LONG)["output_ids"]
    s = Stream(ps, PROMPT, LONG)
    s.wait_tokens(10)
    r = post(ps, "/pause_generation", {"mode": "in_place"})
    assert r.status_code == 200 and r.json()["num_paused_requests"] == 1, r.text
    m = ps.info()["memory"]
    assert m["req_slots_free"] == m["req_slots_total"] - 1 and m["kv_private"] > 0, m  # kept where it was
    n = s.tokens
    time.sleep(0.5)
    assert s.tokens == n < LONG
    # Its KV is the current weights': an update now is refused, and changes nothing.
    r = post(ps, "/update_weights_from_disk", {"model_path": ps.info()["model_path"]})
    assert r.status_code == 409 and r.json()["success"] is False, r.text
    assert r.json()["error"]["code"] == "busy"
    assert post(ps, "/continue_generation", headers=ADMIN).status_code == 200
    assert s.final()["output_ids"] == want
    # abort_all_requests ends what is paused in place (the paused engine still ends aborted requests).
    s = Stream(ps, PROMPT, LONG)
    s.wait_tokens(10)
    assert post(ps, "/pause_generation", {"mode": "in_place"}).status_code == 200
    body = {"model_path": ps.info()["model_path"], "abort_all_requests": True}  # the same weights again
    r = post(ps, "/update_weights_from_disk", body)
    assert r.status_code == 200 and r.json()["num_paused_requests"] == 0, r.text
    assert s.final()["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(ps, "/continue_generation").status_code == 200
    assert generate(ps, PROMPT, LONG)["output_ids"] == want


def test_abort_pause_ends_running_requests_with_abort(ps):
    streams = [Stream(ps, PROMPT, LONG), Stream(ps, [5, 6] * 4, LONG)]
    for s in streams:
        s.wait_tokens(5)
    r = post(ps, "/pause_generation", {})  # SGLang's default mode: abort
    assert r.status_code == 200 and r.json()["mode"] == "abort", r.text
    for s in streams:
        fr = s.final()["meta_info"]["finish_reason"]  # answered before the pause returned
        assert fr["type"] == "abort" and "pause_generation" in fr["message"], fr
    m = ps.info()["memory"]
    assert m["req_slots_free"] == m["req_slots_total"] and m["kv_private"] == 0, m
    assert post(ps, "/continue_generation", None).status_code == 200  # no body: SGLang's {} too


def test_requests_arriving_while_paused_wait_and_run_after_continue(ps):
    want = generate(ps, PROMPT, 12)["output_ids"]
    assert post(ps, "/pause_generation", {"mode": "retract"}).status_code == 200
    got: list[dict] = []
    t = threading.Thread(target=lambda: got.append(generate(ps, PROMPT, 12)), daemon=True)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not got  # waiting
    load = httpx.get(ps.url + "/get_load", headers=USER, timeout=10).json()[0]
    assert load["num_reqs"] == load["num_waiting_reqs"] == 0  # in the front, not the engine: holding nothing
    assert httpx.get(ps.url + "/health_generate", headers=USER, timeout=10).status_code == 200  # paused, alive
    assert post(ps, "/continue_generation").status_code == 200
    t.join(300)
    assert got and got[0]["output_ids"] == want


def test_admin_key_and_malformed_bodies(ps):
    for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
        assert post(ps, path, {}, headers={}).status_code == 401
        r = post(ps, path, {}, headers=USER)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", r.text
    for body in ({"mode": "sleep"}, {"mode": 1}, [1]):
        r = post(ps, "/pause_generation", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == ("mode" if body != [1] else None), r.text
    for raw in (b"{not json", b""):  # no body pauses nothing: {} asks for the default mode
        r = httpx.post(ps.url + "/pause_generation", content=raw, timeout=10,
                       headers={**ADMIN, "content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    for body, param in [
        ({}, "model_path"),
        ({"model_path": 5}, "model_path"),
        ({"model_path": "x", "load_format": 3}, "load_format"),
        ({"model_path": "x", "abort_all_requests": "yes"}, "abort_all_requests"),
        ({"model_path": "x", "flush_cache": False}, "flush_cache"),  # the cache is always flushed
    ]:
        r = post(ps, "/update_weights_from_disk", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert ps.info()["generation_paused"] is None  # nothing above paused anything


def test_update_weights_from_disk(keyed, new_weights, tmp_path, chat_model, tmp_path_factory):
    ps = keyed  # (not the ps fixture: this test restarts the engine on purpose)
    log = str(tmp_path_factory.mktemp("logs") / "fresh.log")
    starting = started_server(new_weights, log)
    fresh = next(starting)
    try:
        want = generate(fresh, P40, 24)["output_ids"]
        turn = [3, 4, 5, 6]
        old = generate(ps, P40, 24)["output_ids"]
        assert old != want  # other weights, other output
        assert generate(ps, P40, 24)["meta_info"]["cached_tokens"] > 0  # the prefix cache serves it
        sid = post(ps, "/open_session", {}, USER).json()
        first = generate(ps, turn, 6, session_params={"id": sid})["output_ids"]
        history = turn + first
        # Refused: a path that does not exist, a checkpoint of other shapes. The old weights serve on.
        wide = build_tiny_model(str(tmp_path / "wide"), "llama", intermediate_size=96, vocab_size=260)
        for body, needle in [
            ({"model_path": str(tmp_path / "missing")}, "model not found"),
            ({"model_path": wide}, "intermediate_size 128 -> 96"),
            ({"model_path": new_weights, "load_format": "pt"}, "load_format 'pt' is not supported"),
        ]:
            r = post(ps, "/update_weights_from_disk", body)
            res = r.json()
            assert r.status_code == 400 and res["success"] is False and needle in res["message"], r.text
            assert res["error"]["type"] == "invalid_request_error" and res["error"]["message"] == res["message"]
        assert generate(ps, P40, 24)["output_ids"] == old
        r = post(ps, "/update_weights_from_disk", {"model_path": new_weights})
        assert r.status_code == 200, r.text
        assert r.json() == {
            "success": True,
            "message": f"Succeeded to update model weights from {new_weights}.",
            "num_paused_requests": 0,
        }
        info = ps.info()
        assert info["model_path"] == new_weights and info["memory"]["kv_cached_evictable"] == 0
        [session] = httpx.get(ps.url + "/memory/pages", headers=ADMIN, timeout=30).json()["sessions"]
        assert info["memory"]["kv_session"] == 0 and session["kv_tokens"] == 0  # (ids: the admin's page map)
        res = generate(ps, P40, 24)
        assert res["output_ids"] == want and res["meta_info"]["cached_tokens"] == 0
        # The session stays open; its next turn recomputes the whole history on the new weights.
        nxt = generate(ps, [9, 10], 8, session_params={"id": sid})
        assert nxt["output_ids"] == generate(fresh, [*history, 9, 10], 8)["output_ids"]
        assert nxt["meta_info"]["cached_tokens"] == 0
        assert post(ps, "/close_session", {"session_id": sid}, USER).status_code == 200
        # An engine restarted after the update loads the new weights, not the ones it started with.
        restarts = ps.info()["engine_restarts"]
        os.kill(ps.info()["engine_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            try:
                info = ps.info()
                if info["engine_restarts"] > restarts and httpx.get(ps.url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, ps.logs()[-2000:]
            time.sleep(0.2)
        assert generate(ps, P40, 24)["output_ids"] == want
    finally:
        starting.close()
        # Back to the module's model, for whoever runs next.
        r = post(ps, "/update_weights_from_disk", {"model_path": chat_model, "abort_all_requests": True})
        assert r.status_code == 200, r.text
    assert generate(ps, P40, 24)["output_ids"] == old
    assert ps.wait_idle_clean()["generation_paused"] is None
