"""Chaos, CI scale: kill -9 and SIGSTOP of the engine under load with sessions open, floods of
disconnecting clients; afterwards every session works with its context, the books are clean and no
process is left (tests/chaos.py has the rules; bench/chaos.py runs it longer)."""

from __future__ import annotations

import asyncio

from tests.chaos import chaos
from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Server, process_alive

WATCHDOG_S = 2.0


def test_chaos_sessions_survive_and_books_balance(chat_model, tmp_path):
    s = Server(
        chat_model, *ENGINE_ARGS, "--watchdog-timeout", str(WATCHDOG_S), log_path=str(tmp_path / "chaos.log")
    )
    try:
        s.wait_healthy()
        vocab = s.info()["engine"]["vocab_size"]
        report = asyncio.run(chaos(s.url, rounds=2, vocab=vocab, watchdog_s=WATCHDOG_S))
        assert [r["signal"] for r in report] == ["SIGKILL", "SIGSTOP"]
        for r in report:
            assert r["noticed_s"] < WATCHDOG_S + 2, r
            assert 503 in r["answers"] or "RemoteProtocolError" in r["answers"], r  # the load saw the crash
        info = s.wait_idle_clean()
        assert info["engine_restarts"] == 2 and info["sessions"] == []
        pids = [r["pid"] for r in report] + [info["engine_pid"]]
        logs = s.logs()
        assert "re-opened 3 session(s) on the restarted engine" in logs
        assert "watchdog: the engine made no progress" in logs
    finally:
        code = s.stop()
    assert code == 0
    assert not any(process_alive(p) for p in pids), "an engine process outlived the server"
