"""One real server on the tiny chat model for all integration tests (started once)."""

from __future__ import annotations

import openai
import pytest

from tests.server_harness import Server

ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--strict-memory",
    "--page-size",
    "16",
    "--max-total-tokens",
    "4096",
    "--max-running-requests",
    "8",
    "--max-queued-requests",
    "64",
    "--chunked-prefill-size",
    "64",
    "--context-length",
    "1024",
    "--max-body-bytes",
    "200000",
    "--max-sessions",
    "8",
    "--log-level",
    "warning",
]


@pytest.fixture(scope="session")
def server(chat_model, tmp_path_factory):
    s = Server(chat_model, *ENGINE_ARGS, log_path=str(tmp_path_factory.mktemp("logs") / "server.log"))
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture
def srv(server):
    """Each test ends with the server's ledger clean once idle and no unexpected engine restart."""
    restarts = server.info()["engine_restarts"]
    yield server
    info = server.wait_idle_clean()
    assert info["engine_restarts"] == restarts, server.logs()[-2000:]


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
