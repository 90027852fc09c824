"""The HTTP front: a FastAPI app wiring the routers (``routes/``), middleware, error handlers and
the engine process's lifecycle (``app.state.start`` / ``stop`` / ``drain``, driven by ``run.py``: a
start-up that fails or is interrupted must bind nothing, which an ASGI lifespan cannot express).

The engine core runs in its own process (``EngineClient``); this process validates, tokenizes,
detokenizes and streams. Every error, on every endpoint, is ``{"error": {message, type, param,
code}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Coroutine
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from ..common import Limits
from ..config import ServerConfig
from ..errors import KVLedgerError
from ..model.chat_templates import install_chat_template
from ..model.loader import DEFAULT_MODEL_NAME, default_model_path, load_tokenizer
from ..version import __version__
from . import handlers
from .admission import InFlight
from .auth import AuthMiddleware, KeyRing
from .control import Control
from .engine_client import EngineClient
from .generation import GenerationService
from .metrics import Metrics
from .middleware import BodyLimitMiddleware, CSRFMiddleware, parse_origins
from .openai_api import OpenAIServing
from .pooling_api import PoolingServing
from .responses import ResponseStore
from .responses_api import ResponsesServing
from .routes import ROUTERS
from .session_journal import SessionJournal
from .session_store import SessionStore
from .state import ServerState
from .tools import make_parser

log = logging.getLogger("kvledger.server")


async def reopen_journaled(client: EngineClient, store: SessionStore) -> None:
    """Re-open on the engine the sessions a previous process left in ``--session-journal`` (tokens,
    no KV: their next turns recompute), one at a time so that one the engine refuses (another model's
    tokens) is dropped alone."""
    n = 0
    for rec in store.snapshot():
        try:
            n += await client.call("restore_sessions", sessions=[rec])
        except KVLedgerError as e:  # (logged without its id: logs are not private)
            log.warning("session journal: a session not re-opened (%s)", e.message)
            store.closed(rec["id"])
    log.warning("re-opened %d session(s) from the session journal; their next turns recompute", n)


def create_app(cfg: ServerConfig) -> FastAPI:
    """The app, or a ValidationError (nothing started) for settings it refuses: keys, origins, a
    journal directory that is not this user's."""
    cfg.check()
    origins = parse_origins(cfg.allowed_origins)
    journal = SessionJournal(cfg.session_journal) if cfg.session_journal else None
    secret = journal.secret() if journal is not None else secrets.token_bytes(32)
    keys = KeyRing(cfg.api_key or [], cfg.admin_api_key, cfg.admin_open, secret)
    srv = ServerState(cfg, Metrics(), keys=keys)
    if cfg.admin_open and cfg.api_key:
        log.warning("--admin-open: every user key may use the admin paths (pause, flush, weights, LoRA)")

    async def set_up(client: EngineClient) -> None:
        """Load the tokenizer while the engine loads the model; set the services up once it is ready."""
        path = cfg.engine.model.model or default_model_path()
        tokenizer = await asyncio.to_thread(load_tokenizer, path)
        # The engine resolves the same template (its end-of-turn tokens are its stop tokens).
        install_chat_template(tokenizer, cfg.engine.model.chat_template, path)
        await client.wait_ready()
        name = cfg.served_model_name or (
            DEFAULT_MODEL_NAME if cfg.engine.model.model is None else client.info["model_name"]
        )
        srv.tokenizer, srv.name, srv.started = tokenizer, name, time.time()
        srv.limits = Limits(**client.limits)
        srv.sessions = SessionStore(
            client.engine_config["max_sessions"], client.engine_config["session_timeout_s"], journal, keys.tag
        )
        # A previous process of this server held sessions: those of keys still configured, not expired.
        if srv.sessions.load_journal(keys.owners()):
            await reopen_journaled(client, srv.sessions)
        holds = client.info.get("disaggregation_mode") != "prefill"  # (prefill holds no session)
        srv.gen = GenerationService(
            client, tokenizer, srv.metrics, srv.sessions, srv.gate, holds, InFlight(srv.admission.max_requests_per_key)
        )
        srv.control = Control(client, srv.gate)

        async def restore_sessions() -> None:
            records = srv.sessions.snapshot()
            if records:
                n = await client.call_unchecked("restore_sessions", sessions=records)
                log.warning("re-opened %d session(s) on the restarted engine; their next turns recompute", n)

        client.on_restart = restore_sessions
        srv.openai = OpenAIServing(
            srv.gen,
            name,
            {os.path.basename(path), "default"},
            srv.limits,
            tokenizer,
            cfg.max_n,
            make_parser(cfg.tool_call_parser),
            cfg.engine.model.reasoning_parser,
            srv.admission,
        )
        srv.openai.adapters = lambda: {a["name"] for a in (srv.client.info.get("loras") or [])}
        srv.responses = ResponsesServing(srv.openai, ResponseStore(cfg.max_stored_responses))
        srv.pooling = PoolingServing(
            srv.gen, srv.openai.check_model, name, srv.limits, tokenizer, cfg.pooling,
            client.engine_config["max_running_requests"], srv.admission,
        )  # fmt: skip
        srv.client = client  # last: the routes take a server with a client as started
        log.info("serving %s on http://%s:%d", name, cfg.host, cfg.port)

    def engine_lost(reason: str) -> None:
        srv.exit_code = 1  # the server (run.py) stops serving and exits 1; the client logged why

    async def start() -> bool:
        """Start the engine and the services; False (the engine already stopped) when it cannot
        start (``srv.exit_code`` 1, the reason logged once) or a signal came first."""
        client = EngineClient(cfg.engine, log_level=cfg.log_level, watchdog_timeout_s=cfg.watchdog_timeout_s)
        client.on_stats = srv.metrics.update_engine
        client.on_stall = srv.metrics.watchdog_stalls.inc
        client.on_death = srv.metrics.engine_died
        client.on_fatal = engine_lost
        client.start()  # the engine loads the model while this process loads the tokenizer
        try:
            if not await _unless(srv.stop_requested, set_up(client)):
                log.warning("start-up interrupted by a signal: stopping the engine")
        except KVLedgerError as e:  # the engine cannot start (the client said why), or not in time
            if client.fatal is None:
                log.error("the server cannot start: %s", e.message)
            srv.exit_code = 1
        finally:
            if srv.client is None:
                await client.close()
        return srv.client is not None

    async def stop() -> None:
        """Stop the engine (after the HTTP server stopped listening and its connections ended)."""
        if srv.client is not None:
            await srv.client.close()

    app = FastAPI(title="kvledger", version=__version__)
    # The last added runs first: CORS (preflights of --allowed-origins), then the cross-site guard,
    # the keys, and the body-size limit.
    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_body_bytes, timeout_s=cfg.body_timeout_s)
    app.add_middleware(AuthMiddleware, keys=keys, logins=srv.logins)
    app.add_middleware(CSRFMiddleware, allowed=origins)
    if origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "x-api-key"],
        )  # fmt: skip
    handlers.install(app)
    for router in ROUTERS:
        app.include_router(router)

    async def drain() -> None:
        """Graceful shutdown: refuse new work (503), give running requests ``grace_period_s`` to
        finish, then abort the rest (they end with finish_reason abort and a clear message)."""
        srv.draining = True
        srv.stop_requested.set()
        await srv.gate.shut_down()  # requests held by a pause get a 503
        client = srv.client
        if client is None:
            return
        deadline = time.monotonic() + cfg.grace_period_s
        while client.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        rids = list(client.streams)
        if rids:
            log.warning("grace period over: aborting %d running requests", len(rids))
        for rid in rids:
            await client.abort(rid, "the server is shutting down")
        deadline = time.monotonic() + 5
        while client.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    app.state.start, app.state.stop, app.state.drain = start, stop, drain
    app.state.server = srv
    return app


async def _unless(stop: asyncio.Event, work: Coroutine[Any, Any, None]) -> bool:
    """Run ``work`` unless ``stop`` is set first (then cancel it): True when it ran to the end."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return False
    task.result()  # its error, if it failed
    return True
