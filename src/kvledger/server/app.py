"""The HTTP front: a FastAPI app wiring the routers (``routes/``), middleware, error handlers and
the engine process's lifecycle.

The engine core runs in its own process (``EngineClient``); this process validates, tokenizes,
detokenizes and streams. Every error, on every endpoint, is ``{"error": {message, type, param,
code}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from fastapi import FastAPI

from .. import __version__
from ..common import Limits
from ..config import ServerConfig
from ..model.loader import DEFAULT_MODEL_NAME, default_model_path, load_tokenizer
from . import handlers
from .auth import AuthMiddleware
from .engine_client import EngineClient
from .generation import GenerationService
from .metrics import Metrics
from .middleware import BodyLimitMiddleware
from .openai_api import OpenAIServing
from .routes import ROUTERS
from .session_store import SessionStore
from .state import ServerState
from .tools import make_parser

log = logging.getLogger("kvledger.server")


def create_app(cfg: ServerConfig) -> FastAPI:
    srv = ServerState(cfg, Metrics())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = EngineClient(cfg.engine, log_level=cfg.log_level, watchdog_timeout_s=cfg.watchdog_timeout_s)
        client.on_stats = srv.metrics.update_engine
        client.on_stall = srv.metrics.watchdog_stalls.inc
        client.on_death = srv.metrics.engine_died
        client.start()  # the engine loads the model while this process loads the tokenizer
        path = cfg.engine.model or default_model_path()
        tokenizer = await asyncio.to_thread(load_tokenizer, path)
        await client.wait_ready()
        name = cfg.served_model_name or (
            DEFAULT_MODEL_NAME if cfg.engine.model is None else client.info["model_name"]
        )
        srv.client, srv.tokenizer, srv.name, srv.started = client, tokenizer, name, time.time()
        srv.limits = Limits(**client.limits)
        srv.sessions = SessionStore(
            client.engine_config["max_sessions"], client.engine_config["session_timeout_s"]
        )
        srv.gen = GenerationService(client, tokenizer, srv.metrics, srv.sessions)

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
        )
        log.info("serving %s on http://%s:%d", name, cfg.host, cfg.port)
        yield
        await client.close()

    app = FastAPI(title="kvledger", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_body_bytes)
    if cfg.api_key or cfg.admin_api_key:
        app.add_middleware(AuthMiddleware, user_key=cfg.api_key, admin_key=cfg.admin_api_key)
    handlers.install(app)
    for router in ROUTERS:
        app.include_router(router)

    async def drain() -> None:
        """Graceful shutdown: refuse new work (503), give running requests ``grace_period_s`` to
        finish, then abort the rest (they end with finish_reason abort and a clear message)."""
        srv.draining = True
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

    app.state.drain = drain
    app.state.server = srv
    return app
