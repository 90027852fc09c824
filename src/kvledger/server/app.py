"""The HTTP front: a FastAPI app wiring the routers (``routes/``), middleware and error handlers to
one server's state, with the engine process's lifecycle (``lifecycle.py``: ``app.state.start`` /
``stop`` / ``drain``, driven by ``run.py``).

The engine core runs in its own process (``EngineClient``); this process validates, tokenizes,
detokenizes and streams. Every error, on every endpoint, is ``{"error": {message, type, param,
code}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from ..config import ServerConfig
from ..version import __version__
from . import handlers
from .auth import AuthMiddleware, KeyRing
from .early_engine import EarlyEngine
from .lifecycle import EngineLifecycle
from .metrics import Metrics
from .middleware import BodyLimitMiddleware, CSRFMiddleware, parse_origins
from .routes import ROUTERS
from .session_journal import SessionJournal
from .state import ServerState

log = logging.getLogger("kvledger.server")


def create_app(cfg: ServerConfig, early: EarlyEngine | None = None) -> FastAPI:
    """The app, or a ValidationError (nothing served) for settings it refuses: keys, origins, a
    journal directory that is not this user's. ``early``: the engine process ``kvledger serve``
    started already, which the app's start adopts."""
    cfg.check()
    origins = parse_origins(cfg.allowed_origins)
    journal = SessionJournal(cfg.session_journal) if cfg.session_journal else None
    secret = journal.secret() if journal is not None else secrets.token_bytes(32)
    keys = KeyRing(cfg.api_key or [], cfg.admin_api_key, cfg.admin_open, secret)
    srv = ServerState(cfg, Metrics(), keys=keys)
    if cfg.admin_open and cfg.api_key:
        log.warning("--admin-open: every user key may use the admin paths (pause, flush, weights, LoRA)")
    life = EngineLifecycle(cfg, srv, journal, early)
    app = FastAPI(title="kvledger", version=__version__)
    _install_middleware(app, cfg, srv, origins)
    handlers.install(app)
    for router in ROUTERS:
        app.include_router(router)
    app.state.start, app.state.stop, app.state.drain = life.start, life.stop, life.drain
    app.state.server = srv
    return app


def _install_middleware(app: FastAPI, cfg: ServerConfig, srv: ServerState, origins: list[str]) -> None:
    """The last added runs first: CORS (preflights of --allowed-origins), then the cross-site guard,
    the keys, and the body-size limit."""
    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_body_bytes, timeout_s=cfg.body_timeout_s)
    app.add_middleware(AuthMiddleware, keys=srv.keys, logins=srv.logins)
    app.add_middleware(CSRFMiddleware, allowed=origins)
    if origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "x-api-key"],
        )  # fmt: skip
