"""Run the HTTP server with a graceful shutdown."""

from __future__ import annotations

import asyncio

import uvicorn

from ..config import ServerConfig
from .app import create_app


class GracefulServer(uvicorn.Server):
    """First SIGTERM/SIGINT: drain (503 for new work, ``grace_period_s`` for running requests, then
    abort the rest with a clear message), then stop; the lifespan then shuts the engine process down.
    A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, app) -> None:
        super().__init__(config)
        self.kv_app = app
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:
            return super().handle_exit(sig, frame)
        self._draining = True
        loop = asyncio.get_event_loop()

        async def drain_then_exit() -> None:
            try:
                await self.kv_app.state.drain()
            finally:
                self.should_exit = True

        loop.call_soon_threadsafe(lambda: loop.create_task(drain_then_exit()))


def serve(cfg: ServerConfig) -> None:
    app = create_app(cfg)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        timeout_graceful_shutdown=int(cfg.grace_period_s) + 10,
    )
    GracefulServer(config, app).run()
