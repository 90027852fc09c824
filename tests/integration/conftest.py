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


def started_server(model: str, log_path: str, *extra: str):
    """A real server on ENGINE_ARGS (plus ``extra``), healthy, stopped when the generator ends."""
    s = Server(model, *ENGINE_ARGS, *extra, log_path=log_path)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def server(chat_model, tmp_path_factory):
    yield from started_server(chat_model, str(tmp_path_factory.mktemp("logs") / "server.log"))


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


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory):
    """One real server on the default model (no --model flag), shared by the SmolLM2 checks."""
    s = Server(
        None,
        "--dtype",
        "float32",
        "--strict-memory",
        "--max-total-tokens",
        "8192",
        "--page-size",
        "16",
        log_path=str(tmp_path_factory.mktemp("logs") / "smol.log"),
    )
    try:
        s.wait_healthy(timeout=300)
        yield s
    finally:
        assert s.stop() == 0
