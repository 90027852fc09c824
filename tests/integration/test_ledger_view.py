"""The ledger, seen live: /memory/pages, the admin key, and /dashboard in a real headless Chromium."""

from __future__ import annotations

import base64
import collections
import itertools
import threading
import time

import httpx
import pytest

from tests.browser import Browser, find_chromium
from tests.integration.conftest import ENGINE_ARGS, started_server
from tests.server_harness import Server, wait_idle

USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}
KINDS = ("free", "cached_evictable", "cached_protected", "private", "session", "quarantined")


@pytest.fixture(scope="module")
def keyed(chat_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "keyed.log")
    for s in started_server(chat_model, log, "--api-key", "user-key", "--admin-api-key", "admin-key"):
        s.headers = ADMIN
        yield s
        s.wait_idle_clean()


def pages(srv, headers=ADMIN) -> httpx.Response:
    return httpx.get(srv.url + "/memory/pages", headers=headers, timeout=30)


def per_kind(snap: dict) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for r in snap["runs"]:
        c[r["kind"]] += r["count"]
    return c


def assert_map_matches_figures(snap: dict) -> None:
    runs = snap["runs"]
    assert runs[0]["start"] == 0
    for a, b in itertools.pairwise(runs):
        assert b["start"] == a["start"] + a["count"] and (a["kind"], a["owner"]) != (b["kind"], b["owner"])
    assert sum(r["count"] for r in runs) == snap["num_pages"]
    m, ps, c = snap["memory"], snap["page_size"], per_kind(snap)
    assert c["unowned"] == 0, runs
    assert snap["num_pages"] * ps == m["kv_total"]
    for kind in KINDS:
        assert c[kind] * ps == m[f"kv_{kind}"], (kind, c, m)


def test_keys_guard_admin_paths(keyed):
    url = keyed.url
    assert pages(keyed, {}).status_code == 401
    r = pages(keyed, USER)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert r.json()["error"]["type"] == "permission_error"
    assert pages(keyed).status_code == 200
    assert pages(keyed, {"x-api-key": "admin-key"}).status_code == 200
    # HTTP Basic is not taken: a browser would resend it by itself to any request, a forged one too.
    basic = base64.b64encode(b"ops:admin-key").decode()
    r = pages(keyed, {"Authorization": f"Basic {basic}"})
    assert r.status_code == 401 and "www-authenticate" not in r.headers
    # The dashboard is a page without data, open to any browser, never framed by another site.
    r = httpx.get(url + "/dashboard", timeout=10)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert r.headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert "http://" not in r.text and "https://" not in r.text  # self-contained: nothing from a CDN
    assert httpx.post(url + "/flush_cache", headers=USER, timeout=10).status_code == 403
    assert httpx.post(url + "/flush_cache", headers=ADMIN, timeout=10).status_code == 200
    # User paths take either key; the admin key is never shown.
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}}
    for h in (USER, ADMIN):
        assert httpx.post(url + "/generate", json=body, headers=h, timeout=30).status_code == 200
    assert httpx.post(url + "/generate", json=body, timeout=30).status_code == 401
    cfg = httpx.get(url + "/get_server_info", headers=USER, timeout=10).json()["server_config"]
    assert cfg["api_key"] == cfg["admin_api_key"] == "***"


def test_the_dashboards_login_is_a_cookie_that_only_reads(keyed):
    """POST /dashboard/login with the admin key gives a cookie (HttpOnly, SameSite=Strict) that opens
    GET /memory/pages and nothing else; a user key cannot log in; a cross-site login is refused."""
    url = keyed.url
    r = httpx.post(url + "/dashboard/login", json={}, headers=USER, timeout=10)
    assert r.status_code == 403 and "set-cookie" not in r.headers
    r = httpx.post(url + "/dashboard/login", content=b"{}", headers={**ADMIN, "content-type": "text/plain"})
    assert r.status_code == 415 and "set-cookie" not in r.headers
    r = httpx.post(url + "/dashboard/login", json={}, headers={**ADMIN, "origin": "http://evil.example"})
    assert r.status_code == 403 and "set-cookie" not in r.headers
    r = httpx.post(url + "/dashboard/login", json={}, headers=ADMIN, timeout=10)
    assert r.status_code == 200
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "admin-key" not in cookie
    jar = {"Cookie": cookie.split(";", 1)[0]}
    assert httpx.get(url + "/memory/pages", headers=jar, timeout=10).status_code == 200
    assert httpx.post(url + "/flush_cache", headers=jar, timeout=10).status_code == 401  # reads only
    assert httpx.get(url + "/get_server_info", headers=jar, timeout=10).status_code == 401
    bad = {"Cookie": "kvledger_dashboard=forged"}
    assert httpx.get(url + "/memory/pages", headers=bad, timeout=10).status_code == 401


def _start_long(srv, headers: dict, rid: str) -> threading.Thread:
    body = {"rid": rid, "input_ids": [7] * 9, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    t = threading.Thread(
        target=httpx.post, args=(srv.url + "/generate",), kwargs=dict(json=body, headers=headers, timeout=120)
    )
    t.start()
    return t


def _wait_running(srv, rid: str) -> None:
    deadline = time.monotonic() + 20
    while rid not in {r["rid"] for r in pages(srv).json()["requests"]}:
        assert time.monotonic() < deadline, f"{rid} never ran"
        time.sleep(0.05)


def test_only_the_admin_aborts_another_callers_request(keyed):
    abort = keyed.url + "/abort_request"
    t = _start_long(keyed, ADMIN, "admins-own")
    _wait_running(keyed, "admins-own")
    r = httpx.post(abort, json={"rid": "admins-own"}, headers=USER, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_request_owner"
    assert httpx.post(abort, json={"rid": "admins-own"}, headers=ADMIN, timeout=10).status_code == 200
    t.join()
    t = _start_long(keyed, USER, "users-own")
    _wait_running(keyed, "users-own")
    assert httpx.post(abort, json={"rid": "users-own"}, headers=USER, timeout=10).status_code == 200
    t.join()


def test_page_map_adds_up_under_load_and_names_owners(keyed):
    sid = httpx.post(keyed.url + "/open_session", json={}, headers=USER, timeout=10).json()
    body = {"input_ids": [11] * 40, "sampling_params": {"max_new_tokens": 4}, "session_params": {"id": sid}}
    assert httpx.post(keyed.url + "/generate", json=body, headers=USER, timeout=30).status_code == 200
    threads = [_start_long(keyed, USER, f"load-{i}") for i in range(3)]
    _wait_running(keyed, "load-0")
    seen_private = False
    for _ in range(10):
        snap = pages(keyed).json()
        assert_map_matches_figures(snap)
        owners = {r["owner"] for r in snap["runs"] if r["kind"] == "private"}
        live = {f"req {r['rid']}" for r in snap["requests"]}
        assert owners <= live
        seen_private |= bool(owners)
    assert seen_private
    assert any(r["kind"] == "session" and r["owner"] == f"session {sid}" for r in snap["runs"])
    assert any(s["id"] == sid for s in snap["sessions"])
    # Session ids are the admin's on the page map only: /get_server_info counts sessions, for any key
    # (the session's own user key included).
    for key in (ADMIN, USER):
        info = httpx.get(keyed.url + "/get_server_info", headers=key, timeout=10)
        assert sid not in info.text and info.json()["session_counts"]["open"] >= 1
    for i in range(3):
        httpx.post(keyed.url + "/abort_request", json={"rid": f"load-{i}"}, headers=USER, timeout=10)
    for t in threads:
        t.join()
    keyed.wait_idle_clean()
    snap = pages(keyed).json()
    assert_map_matches_figures(snap)
    assert snap["requests"] == [] and snap["last_audit"]["ok"]
    assert httpx.post(keyed.url + "/close_session", json={"session_id": sid}, headers=USER).status_code == 200


def test_quarantined_pages_are_shown_counted_and_given_back(chat_model, tmp_path):
    """Production mode (issue 50, item 12): the audit's walk of owners misses a running request
    (KVLEDGER_TEST_LEDGER_MISSES_RID): its pages and slot are quarantined, not freed — shown on
    /memory/pages (kind ``quarantined``), in /get_server_info's memory and /metrics — and given back
    when the request ends."""
    args = [a for a in ENGINE_ARGS if a != "--strict-memory"]
    s = Server(chat_model, *args, "--audit-interval-s", "0.2", log_path=str(tmp_path / "quarantine.log"),
               env={"KVLEDGER_TEST_LEDGER_MISSES_RID": "hidden"})  # fmt: skip
    try:
        s.wait_healthy()
        t = _start_long(s, {}, "hidden")
        deadline = time.monotonic() + 30
        while True:
            snap = pages(s, {}).json()
            runs = [r for r in snap["runs"] if r["kind"] == "quarantined"]
            if runs and "hidden" in {r["rid"] for r in snap["requests"]}:
                break
            assert time.monotonic() < deadline, snap
            time.sleep(0.05)
        assert all(r["owner"].startswith("quarantine (last owner: req hidden") for r in runs)
        # (Pages it took since the last audit are still unowned on the map: the walk misses them.)
        m, ps = snap["memory"], snap["page_size"]
        assert sum(r["count"] for r in snap["runs"]) == snap["num_pages"]
        assert per_kind(snap)["quarantined"] * ps == m["kv_quarantined"] > 0
        assert m["leak_check"]["quarantined_pages_total"] > 0 and m["req_slots_quarantined"] == 1
        assert s.info()["memory"]["kv_quarantined"] > 0
        while True:  # (the front's metrics follow the engine's stats, pushed as it steps)
            metrics = httpx.get(s.url + "/metrics", timeout=10).text
            line = next((x for x in metrics.splitlines() if x.startswith('kvledger_kv_tokens{state="quarantined"}')), "")
            if line and float(line.split()[-1]) > 0:
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)
        assert 'kvledger_memory_quarantine{what="quarantined_pages"}' in metrics
        httpx.post(s.url + "/abort_request", json={"rid": "hidden"}, timeout=10)
        t.join()
        info, idle = wait_idle(s.url, 20)
        m = info["memory"]
        assert idle and m["kv_quarantined"] == 0 and m["req_slots_quarantined"] == 0, m
        assert m["req_slots_free"] == m["req_slots_total"] and m["kv_free"] + m["kv_cached_evictable"] == m["kv_total"]
        assert pages(s, {}).json()["last_audit"]["ok"]
        assert info["engine_restarts"] == 0
    finally:
        s.stop()


CHROMIUM = find_chromium()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (Debian package 'chromium'; .ci/run installs it)")
def test_dashboard_draws_the_page_map_in_a_browser(keyed, tmp_path):
    sid = httpx.post(keyed.url + "/open_session", json={}, headers=USER, timeout=10).json()
    body = {"input_ids": [13] * 50, "sampling_params": {"max_new_tokens": 5}, "session_params": {"id": sid}}
    assert httpx.post(keyed.url + "/generate", json=body, headers=USER, timeout=30).status_code == 200
    body = {"input_ids": [17] * 70, "sampling_params": {"max_new_tokens": 3}}  # leaves cached pages
    assert httpx.post(keyed.url + "/generate", json=body, headers=USER, timeout=30).status_code == 200
    keyed.wait_idle_clean()
    snap = pages(keyed).json()
    expected = {k: v for k, v in per_kind(snap).items() if v}
    assert {"free", "session", "cached_evictable"} <= set(expected)
    browser = Browser(CHROMIUM)
    try:
        browser.open(keyed.url + "/dashboard")  # no key: the page asks for it, once
        browser.wait_for("!document.getElementById('login').hidden")
        assert browser.evaluate("Number(document.body.dataset.draws || 0)") == 0
        for key, drawn in (("user-key", False), ("admin-key", True)):
            browser.evaluate(f"document.getElementById('key').value = '{key}'; "
                             "document.getElementById('login').requestSubmit(); true")  # fmt: skip
            if not drawn:
                browser.wait_for("document.getElementById('status').textContent.includes('login refused')")
        browser.wait_for("Number(document.body.dataset.draws || 0) >= 1")
        assert browser.evaluate("document.getElementById('login').hidden")
        assert browser.evaluate("document.getElementById('key').value") == ""  # the page keeps no key
        # Count the pages by the colour the browser actually painted (the centre pixel of each page's
        # square on the canvas), named through the legend's swatches.
        drawn = browser.evaluate(
            """(() => {
              const names = {};
              for (const i of document.querySelectorAll('#legend i')) {
                const rgb = getComputedStyle(i).backgroundColor.match(/\\d+/g).slice(0, 3).join(',');
                names[rgb] = i.className.slice(2);
              }
              const canvas = document.getElementById('grid');
              const {cell, gap, cols} = canvas.dataset;
              const px = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
              const counts = {}, half = Math.floor((cell - gap) / 2);
              const rows = Math.floor(canvas.height / cell);
              for (let p = 0; p < rows * cols; p++) {
                const x = (p % cols) * cell + half, y = Math.floor(p / cols) * cell + half;
                const o = (y * canvas.width + x) * 4;
                if (px[o + 3] === 0) continue;  // past the last page: nothing painted
                const k = names[[px[o], px[o + 1], px[o + 2]].join(',')] || 'unknown colour';
                counts[k] = (counts[k] || 0) + 1;
              }
              return counts;
            })()"""
        )
        assert drawn == expected
        assert browser.evaluate("document.querySelector('#sessions tbody').textContent").startswith(sid)
        assert "error" not in browser.evaluate("document.getElementById('status').className")
        shot = tmp_path / "dashboard.png"
        browser.screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
    finally:
        browser.close()
        httpx.post(keyed.url + "/close_session", json={"session_id": sid}, headers=USER, timeout=10)
