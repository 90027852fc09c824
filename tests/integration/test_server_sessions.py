"""Streaming sessions over HTTP: the seed scenarios against the real server."""

from __future__ import annotations

import asyncio
import os
import stat
import time

import httpx
import pytest

from tests.integration.conftest import started_server

G = {"temperature": 0, "ignore_eos": True}


def open_session(srv, **body) -> httpx.Response:
    return httpx.post(srv.url + "/open_session", json=body, timeout=30)


def turn(srv, sid: str, ids: list[int], n: int = 6, **extra) -> httpx.Response:
    body = {
        "input_ids": ids,
        "sampling_params": {**G, "max_new_tokens": n},
        "session_params": {"id": sid},
        **extra,
    }
    return httpx.post(srv.url + "/generate", json=body, timeout=60)


def close(srv, sid: str) -> httpx.Response:
    return httpx.post(srv.url + "/close_session", json={"session_id": sid}, timeout=30)


def held(srv) -> tuple[int, int]:
    info = srv.info()
    return info["memory"]["kv_session"], sum(s["held_tokens"] for s in info["sessions"])


def test_turns_reuse_kv_and_match_full_prompts(srv):
    sid = open_session(srv).json()
    assert isinstance(sid, str)
    history: list[int] = []
    for i, t in enumerate([[5, 6, 7, 8] * 5, [9] * 30, [10, 11]]):
        r = turn(srv, sid, t)
        assert r.status_code == 200, r.text
        out = r.json()
        full = httpx.post(
            srv.url + "/generate",
            json={"input_ids": history + t, "sampling_params": {**G, "max_new_tokens": 6}},
        ).json()
        assert out["output_ids"] == full["output_ids"]
        if i:
            assert out["meta_info"]["cached_tokens"] == (len(history) - 1) // 16 * 16
        history = history + t + out["output_ids"]
        kv_session, total = held(srv)
        assert kv_session == total > 0
    metrics = httpx.get(srv.url + "/metrics").text
    assert "kvledger_num_streaming_sessions 1.0" in metrics
    assert close(srv, sid).status_code == 200
    assert held(srv) == (0, 0)
    assert turn(srv, sid, [1]).status_code == 404
    assert close(srv, sid).status_code == 404


def test_open_conflict_and_cap(srv):
    a = open_session(srv, session_id="fixed-id")
    assert a.status_code == 200 and a.json() == "fixed-id"
    dup = open_session(srv, session_id="fixed-id")
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "session_exists"
    ids = ["fixed-id"]
    while True:  # a flood up to the cap (8)
        r = open_session(srv)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "too_many_sessions"
            break
        assert r.status_code == 200
        ids.append(r.json())
        assert len(ids) <= 8
    assert len(ids) == 8
    for sid in ids:
        assert turn(srv, sid, [4, 5, 6], n=2).status_code == 200
    kv_session, total = held(srv)
    assert kv_session == total > 0
    for sid in ids:
        assert close(srv, sid).status_code == 200
    assert held(srv) == (0, 0)


def test_busy_and_close_while_decoding(srv):
    sid = open_session(srv).json()

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            body = {
                "input_ids": [7] * 10,
                "sampling_params": {**G, "max_new_tokens": 600},
                "session_params": {"id": sid},
            }
            running = asyncio.create_task(c.post("/generate", json=body))
            for _ in range(100):
                await asyncio.sleep(0.05)
                if any(s["busy_rid"] for s in srv.info()["sessions"]):
                    break
            busy = await c.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1}})
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"
            assert (await c.post("/close_session", json={"session_id": sid})).status_code == 200  # deferred
            again = await c.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1}})
            assert again.status_code == 404
            r = await running
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 600

    asyncio.run(main())
    assert held(srv) == (0, 0)


def test_over_long_turn_keeps_the_session(srv):
    sid = open_session(srv).json()
    first = turn(srv, sid, list(range(3, 200)), n=10)
    assert first.status_code == 200
    before = held(srv)
    r = turn(srv, sid, [5] * 900, n=1)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert held(srv) == before
    nxt = turn(srv, sid, [8, 9], n=3)
    assert nxt.status_code == 200 and nxt.json()["meta_info"]["cached_tokens"] == (197 + 10 - 1) // 16 * 16
    close(srv, sid)


def test_disconnect_mid_turn_then_immediate_next_turn(srv):
    sid = open_session(srv).json()
    first = [3, 4, 5, 6] * 5  # 20 prompt tokens + 4 output: the session holds one full page of 16
    t1 = turn(srv, sid, first, n=4).json()
    before = held(srv)
    assert before[0] == 32  # its KV (23 tokens) in two pages of 16
    body = {
        "input_ids": [9] * 12,
        "sampling_params": {**G, "max_new_tokens": 800},
        "session_params": {"id": sid},
        "stream": True,
    }
    with httpx.stream("POST", srv.url + "/generate", json=body, timeout=30) as r:
        next(ln for ln in r.iter_lines() if ln.startswith("data:"))
    # The very next turn: the disconnected one must be gone and must not have written into the session.
    t0 = time.monotonic()
    while True:
        nxt = turn(srv, sid, [20, 21], n=4)
        if nxt.status_code != 409 or time.monotonic() - t0 > 1.0:
            break
        time.sleep(0.05)
    assert nxt.status_code == 200, nxt.text
    full = httpx.post(
        srv.url + "/generate",
        json={
            "input_ids": first + t1["output_ids"] + [20, 21],
            "sampling_params": {**G, "max_new_tokens": 4},
        },
    ).json()
    assert nxt.json()["output_ids"] == full["output_ids"]
    # Exactly turn 1's full page is reused: the dropped turn wrote nothing into the session (had it,
    # the conversation would be 12+ tokens longer and the cached prefix different).
    assert nxt.json()["meta_info"]["cached_tokens"] == (len(first) + 4 - 1) // 16 * 16 == 16
    close(srv, sid)


def test_abort_of_a_queued_turn(srv):
    sid = open_session(srv).json()
    turn(srv, sid, [3, 4, 5], n=2)
    before = held(srv)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            # Long enough to still run when the turn comes (300 tokens took under 0.4 s on a quiet box:
            # the turn was admitted, not queued); aborted once the check is done.
            blockers = [
                asyncio.create_task(
                    c.post(
                        "/generate",
                        json={
                            "input_ids": [i + 3] * 5,
                            "rid": f"blocker-{i}",
                            "sampling_params": {**G, "max_new_tokens": 1000},
                        },
                    )
                )
                for i in range(8)
            ]
            await asyncio.sleep(0.3)
            queued = asyncio.create_task(
                c.post(
                    "/generate",
                    json={
                        "input_ids": [50] * 5,
                        "rid": "queued-turn",
                        "session_params": {"id": sid},
                        "sampling_params": {**G, "max_new_tokens": 50},
                    },
                )
            )
            # On a loaded 2-core box the turn may take a moment to reach the engine: 404 until then.
            for _ in range(100):
                await asyncio.sleep(0.1)
                assert not queued.done(), "the turn finished before it could be aborted in the queue"
                if (await c.post("/abort_request", json={"rid": "queued-turn"})).status_code == 200:
                    break
            else:
                raise AssertionError("the queued turn was never known to the server")
            r = await queued
            assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
            for i in range(8):
                await c.post("/abort_request", json={"rid": f"blocker-{i}"})
            await asyncio.gather(*blockers)

    asyncio.run(main())
    assert held(srv) == before
    assert turn(srv, sid, [6], n=2).status_code == 200
    close(srv, sid)


def test_session_bad_inputs(srv):
    sid = open_session(srv).json()
    for sp, code in (
        ({"id": "nope"}, 404),
        ({"id": sid, "replace": True}, 400),
        ({"id": sid, "offset": 99}, 400),
        ({"id": sid, "rid": "x"}, 400),
    ):
        r = httpx.post(srv.url + "/generate", json={"input_ids": [1], "session_params": sp})
        assert r.status_code == code, (sp, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(srv.url + "/open_session", json={"timeout": -1}).status_code == 400
    assert httpx.post(srv.url + "/close_session", json={}).status_code == 400
    close(srv, sid)


# -- sessions are their owners' -------------------------------------------------------------------------

KEY_A, KEY_B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
HICACHE_SALT = "hicache-pepper-7f3a"
APP = "http://app.example:8080"


@pytest.fixture(scope="module")
def tenants(chat_model, tmp_path_factory):
    """Two user keys and no admin key (logs at info, to look for ids in them)."""
    log = str(tmp_path_factory.mktemp("logs") / "tenants.log")
    args = ("--api-key", "key-a", "key-b", "--hicache-salt", HICACHE_SALT, "--log-level", "info",
            "--allowed-origins", APP)  # fmt: skip
    for s in started_server(chat_model, log, *args):
        s.headers = KEY_A
        yield s
        s.wait_idle_clean()


def _unknown(sid: str, param: str) -> dict:
    """The engine's answer for a session that does not exist."""
    return {"error": {"message": f"no open session {sid!r}", "type": "not_found_error", "param": param,
                      "code": "session_not_found"}}  # fmt: skip


def test_a_session_is_its_keys_alone(tenants):
    """Another key naming a session gets the 404 of a session that does not exist, on a turn and on a
    close, and changes nothing; info, metrics and logs show no key's session ids, and no salt."""
    url = tenants.url
    sid = httpx.post(url + "/open_session", json={}, headers=KEY_A, timeout=30).json()
    body = {"input_ids": [5, 6, 7], "sampling_params": {**G, "max_new_tokens": 3}, "session_params": {"id": sid}}
    first = httpx.post(url + "/generate", json=body, headers=KEY_A, timeout=60)
    assert first.status_code == 200, first.text
    never = httpx.post(url + "/generate", json={**body, "session_params": {"id": "never"}}, headers=KEY_B)
    assert never.status_code == 404 and never.json() == _unknown("never", "session_params.id")
    for stream in (False, True):
        r = httpx.post(url + "/generate", json={**body, "stream": stream}, headers=KEY_B, timeout=60)
        assert r.status_code == 404 and r.json() == _unknown(sid, "session_params.id"), r.text
    r = httpx.post(url + "/close_session", json={"session_id": sid}, headers=KEY_B, timeout=30)
    assert r.status_code == 404 and r.json() == _unknown(sid, "session_id")
    # The same salt or none: a turn with another salt is not this session's either.
    salted = httpx.post(url + "/generate", json={**body, "cache_salt": "other"}, headers=KEY_A, timeout=60)
    assert salted.status_code == 404 and salted.json() == _unknown(sid, "session_params.id")

    # No user key sees a session id in /get_server_info, its own neither: counts only; and no salt, no key.
    for key in (KEY_A, KEY_B):
        info = httpx.get(url + "/get_server_info", headers=key, timeout=30)
        assert sid not in info.text and HICACHE_SALT not in info.text and "key-a" not in info.text
        assert "sessions" not in info.json() and info.json()["session_counts"]["open"] == 1
        assert info.json()["engine_config"]["hicache_salt"] == info.json()["server_config"]["api_key"] == "***"
    assert sid not in httpx.get(url + "/metrics", timeout=30).text
    # Key A's session was untouched by key B: its next turn continues the whole conversation.
    again = httpx.post(url + "/generate", json=body, headers=KEY_A, timeout=60).json()
    assert again["meta_info"]["prompt_tokens"] == 3 + 3 + 3
    assert httpx.post(url + "/close_session", json={"session_id": sid}, headers=KEY_A).status_code == 200
    logs = tenants.logs()  # (each record is flushed as it is logged)
    assert "POST /close_session" in logs and sid not in logs and HICACHE_SALT not in logs


def test_a_user_key_is_not_an_admin_key(tenants):
    """With --api-key and no --admin-api-key the admin paths are refused (403) and change nothing:
    a refused pause leaves generation running."""
    url = tenants.url
    for path, body in [("/pause_generation", {"mode": "abort"}), ("/flush_cache", {}),
                       ("/update_weights_from_disk", {"model_path": "/nowhere"}),
                       ("/unload_lora_adapter", {"lora_name": "x"}), ("/dashboard/login", {})]:  # fmt: skip
        r = httpx.post(url + path, json=body, headers=KEY_A, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", (path, r.text)
        assert "--admin-open" in r.json()["error"]["message"]
    assert httpx.get(url + "/memory/pages", headers=KEY_A, timeout=30).status_code == 403
    assert httpx.get(url + "/get_server_info", headers=KEY_A, timeout=30).json()["generation_paused"] is None
    r = httpx.post(url + "/generate", json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}},
                   headers=KEY_B, timeout=30)  # fmt: skip
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_allowed_origins_get_cors_and_others_are_refused(tenants):
    pre = {"origin": APP, "access-control-request-method": "POST",
           "access-control-request-headers": "authorization,content-type"}  # fmt: skip
    r = httpx.options(tenants.url + "/generate", headers=pre, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    r = httpx.options(tenants.url + "/generate", headers={**pre, "origin": "http://evil.example"}, timeout=30)
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    body = {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}}
    for origin, status in ((APP, 200), ("http://app.example", 403), ("http://evil.example", 403)):
        r = httpx.post(tenants.url + "/generate", json=body, headers={**KEY_A, "origin": origin}, timeout=30)
        assert r.status_code == status, (origin, r.text)


def test_only_its_key_aborts_a_request(tenants):
    """Without an admin key nobody may abort another key's request (before: anyone could)."""
    body = {"rid": "a-long", "input_ids": [7] * 9, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}

    async def main():
        async with httpx.AsyncClient(base_url=tenants.url, timeout=120) as c:
            running = asyncio.create_task(c.post("/generate", json=body, headers=KEY_A))
            for _ in range(200):
                await asyncio.sleep(0.05)
                r = await c.post("/abort_request", json={"rid": "a-long"}, headers=KEY_B)
                if r.status_code != 404:
                    break
            assert r.status_code == 403 and r.json()["error"]["code"] == "not_request_owner", r.text
            assert (await c.post("/abort_request", json={"rid": "a-long"}, headers=KEY_A)).status_code == 200
            done = await running
            assert done.json()["meta_info"]["finish_reason"]["type"] == "abort"

    asyncio.run(main())


def test_the_journal_is_private_and_restores_only_live_sessions_of_known_keys(chat_model, tmp_path):
    """--session-journal: the directory 0700 and its files 0600; after a restart, a session whose
    timeout passed while the server was down is not re-opened, nor one whose key is no longer
    configured (its file removed), and the live one continues its conversation. The second server
    also shows --admin-open: a user key may then use the admin paths."""
    journal = str(tmp_path / "journal")
    args = ("--session-journal", journal, "--api-key", "key-a", "key-b")
    ids = {}
    for s in started_server(chat_model, str(tmp_path / "first.log"), *args):
        s.headers = KEY_A
        # ("short" last: opening a session prunes expired records, and it must still be journaled.)
        for name, key, timeout in (("long", KEY_A, 600.0), ("b", KEY_B, 600.0), ("short", KEY_A, 2.0)):
            ids[name] = httpx.post(s.url + "/open_session", json={"timeout": timeout}, headers=key).json()
            body = {"input_ids": [5, 6, 7], "sampling_params": {**G, "max_new_tokens": 3},
                    "session_params": {"id": ids[name]}}  # fmt: skip
            assert httpx.post(s.url + "/generate", json=body, headers=key, timeout=60).status_code == 200
        s.wait_idle_clean()
    files = os.listdir(journal)
    assert len(files) == 4 and "owner.key" in files  # three sessions and the owner tags' secret
    assert stat.S_IMODE(os.stat(journal).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(os.path.join(journal, f)).st_mode) == 0o600 for f in files)
    time.sleep(2.5)  # "short" expires while the server is down
    args = ("--session-journal", journal, "--api-key", "key-a", "--admin-open")  # key-b is gone
    for s in started_server(chat_model, str(tmp_path / "second.log"), *args):
        s.headers = KEY_A
        assert s.info()["session_counts"]["open"] == 1
        assert len(os.listdir(journal)) == 2  # "long" and the secret: the others' files are gone
        for name in ("short", "b"):
            body = {"input_ids": [8], "session_params": {"id": ids[name]}}
            r = httpx.post(s.url + "/generate", json=body, headers=KEY_A, timeout=60)
            assert r.status_code == 404 and r.json() == _unknown(ids[name], "session_params.id")
        body = {"input_ids": [8], "sampling_params": {**G, "max_new_tokens": 2}, "session_params": {"id": ids["long"]}}
        r = httpx.post(s.url + "/generate", json=body, headers=KEY_A, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 3 + 3 + 1
        assert httpx.post(s.url + "/flush_cache", headers=KEY_A, timeout=30).status_code == 200  # --admin-open
        assert httpx.post(s.url + "/close_session", json={"session_id": ids["long"]}, headers=KEY_A).status_code == 200
        s.wait_idle_clean()
