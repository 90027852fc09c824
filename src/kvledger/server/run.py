"""Run the HTTP server with a graceful shutdown."""

from __future__ import annotations

import asyncio

import uvicorn

from ..config import ServerConfig
from .app import create_app
from .early_engine import EarlyEngine


class GracefulServer(uvicorn.Server):
    """First SIGTERM/SIGINT: drain (503 for new work, ``grace_period_s`` for running requests, then
    abort the rest with a clear message), then stop listening and shut the engine process down.
    A signal during start-up stops it at once (the engine is terminated, nothing is served, exit 0).
    A second signal stops at once. An engine that cannot be (re)started stops the server (exit 1)."""

    def __init__(self, config: uvicorn.Config, app) -> None:
        super().__init__(config)
        self.kv_app = app
        self.kv_state = app.state.server
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

    async def startup(self, sockets=None) -> None:
        """The engine first: a start-up that fails or a signal interrupts binds nothing."""
        if not await self.kv_app.state.start():
            self.should_exit = True
            return
        await super().startup(sockets)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)  # stop listening; running requests have ended (drain)
        await self.kv_app.state.stop()

    async def on_tick(self, counter: int) -> bool:
        if self.kv_state.exit_code is not None:  # the engine is gone for good
            return True
        return await super().on_tick(counter)


def serve(cfg: ServerConfig, early: EarlyEngine | None = None) -> int:
    """Serve until a signal (exit status 0) or an engine that cannot be started (1). ``early``: the
    engine process already started (``early_engine.py``): stopped if the app cannot be made."""
    try:
        app = create_app(cfg, early)
    except BaseException:
        if early is not None:
            early.stop()
        raise
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        lifespan="off",  # the engine's start and stop are this server's (startup, shutdown)
        timeout_graceful_shutdown=int(cfg.grace_period_s) + 10,
    )
    server = GracefulServer(config, app)
    if early is not None:
        early.disarm()  # the signals are uvicorn's from here (GracefulServer.handle_exit)
    server.run()
    return server.kv_state.exit_code or 0
