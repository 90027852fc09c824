"""The engine process's life as the front sees it: ``start`` (the engine process and the tokenizer
loaded side by side, then the services built once the engine is ready; interruptible by a signal),
``stop``, and the graceful ``drain``. ``create_app`` hands these three to ``run.py`` through
``app.state`` (a start-up that fails or is interrupted must bind nothing, which an ASGI lifespan
cannot express)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine
from typing import Any

from ..common import Limits
from ..config import ServerConfig
from ..errors import KVLedgerError
from ..model.chat_templates import install_chat_template
from ..model.loader import DEFAULT_MODEL_NAME, default_model_path, load_tokenizer
from ..multimodal.media import MediaLimits
from ..multimodal.processor import ImageProcessing
from .admission import InFlight
from .control import Control
from .early_engine import EarlyEngine
from .engine_client import EngineClient
from .generation import GenerationService
from .openai_api import OpenAIServing
from .pooling_api import PoolingServing
from .responses_api import ResponsesServing
from .responses_store import ResponseStore
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


class EngineLifecycle:
    """Starts, stops and drains the engine behind one server's state (``srv``): the services the
    handlers use are set on ``srv`` by ``start``, ``srv.client`` last."""

    def __init__(
        self, cfg: ServerConfig, srv: ServerState, journal: SessionJournal | None, early: EarlyEngine | None = None
    ) -> None:
        self.cfg = cfg
        self.srv = srv
        self.journal = journal
        self.early = early  # an engine process ``kvledger serve`` started already (its generation 1)

    async def start(self) -> bool:
        """Start the engine and the services; False (the engine already stopped) when it cannot
        start (``srv.exit_code`` 1, the reason logged once) or a signal came first."""
        cfg, srv = self.cfg, self.srv
        client = EngineClient(
            cfg.engine, log_level=cfg.log_level, watchdog_timeout_s=cfg.watchdog_timeout_s, early=self.early
        )
        self.early = None  # the client's now
        client.on_stats = srv.metrics.update_engine
        client.on_stall = srv.metrics.watchdog_stalls.inc
        client.on_death = srv.metrics.engine_died
        client.on_fatal = self._engine_lost
        client.start()  # the engine loads the model while this process loads the tokenizer
        try:
            if not await _unless(srv.stop_requested, self._set_up(client)):
                log.warning("start-up interrupted by a signal: stopping the engine")
        except KVLedgerError as e:  # the engine cannot start (the client said why), or not in time
            if client.fatal is None:
                log.error("the server cannot start: %s", e.message)
            srv.exit_code = 1
        finally:
            if srv.client is None:
                await client.close()
        return srv.client is not None

    async def stop(self) -> None:
        """Stop the engine (after the HTTP server stopped listening and its connections ended)."""
        if getattr(self.srv, "openai", None) is not None:
            self.srv.openai.close()
        if self.srv.client is not None:
            await self.srv.client.close()

    async def drain(self) -> None:
        """Graceful shutdown: refuse new work (503), give running requests ``grace_period_s`` to
        finish, then abort the rest (they end with finish_reason abort and a clear message)."""
        srv = self.srv
        srv.draining = True
        srv.stop_requested.set()
        if srv.client is not None:  # an engine stopped by the same signal is not restarted
            srv.client.expect_stop()
        await srv.gate.shut_down()  # requests held by a pause get a 503
        client = srv.client
        if client is None:
            return
        deadline = time.monotonic() + self.cfg.grace_period_s
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

    def _engine_lost(self, reason: str) -> None:
        self.srv.exit_code = 1  # the server (run.py) stops serving and exits 1; the client logged why

    async def _set_up(self, client: EngineClient) -> None:
        """Load the tokenizer while the engine loads the model; set the services up once it is ready."""
        cfg, srv = self.cfg, self.srv
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
        await self._open_sessions(client)
        self._make_services(client, tokenizer, name, path)
        srv.client = client  # last: the routes take a server with a client as started
        log.info("serving %s on http://%s:%d", name, cfg.host, cfg.port)

    async def _open_sessions(self, client: EngineClient) -> None:
        """The front's session store, with the journal's sessions re-opened on the engine, and the
        hook that re-opens them on an engine that restarts."""
        srv = self.srv
        srv.sessions = SessionStore(
            client.engine_config["max_sessions"], client.engine_config["session_timeout_s"], self.journal,
            srv.keys.tag,
        )  # fmt: skip
        # A previous process of this server held sessions: those of keys still configured, not expired.
        if srv.sessions.load_journal(srv.keys.owners()):
            await reopen_journaled(client, srv.sessions)

        async def restore_sessions() -> None:
            records = srv.sessions.snapshot()
            if records:
                n = await client.call_unchecked("restore_sessions", sessions=records)
                log.warning("re-opened %d session(s) on the restarted engine; their next turns recompute", n)

        client.on_restart = restore_sessions

    def _make_services(self, client: EngineClient, tokenizer: Any, name: str, path: str) -> None:
        """The services the routes call: generation, control, the OpenAI, Responses and pooling APIs."""
        cfg, srv = self.cfg, self.srv
        holds = client.info.get("disaggregation_mode") != "prefill"  # (prefill holds no session)
        srv.gen = GenerationService(
            client, tokenizer, srv.metrics, srv.sessions, srv.gate, holds, InFlight(srv.admission.max_requests_per_key)
        )
        srv.control = Control(client, srv.gate)
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
            ImageProcessing.for_model(path) if os.path.isdir(path) else None,
            MediaLimits(
                cfg.max_image_bytes, cfg.max_image_pixels, cfg.allowed_local_media_path, cfg.allow_remote_media,
                tuple(cfg.allowed_media_domains) if cfg.allowed_media_domains else None,
                cfg.media_fetch_timeout_s, cfg.media_max_redirects,
            ),
            cfg.max_images_per_prompt,
        )
        srv.openai.adapters = lambda: {a["name"] for a in (srv.client.info.get("loras") or [])}
        srv.responses = ResponsesServing(srv.openai, ResponseStore(cfg.max_stored_responses))
        srv.pooling = PoolingServing(
            srv.gen, srv.openai.check_model, name, srv.limits, tokenizer, cfg.pooling,
            client.engine_config["max_running_requests"], srv.admission, srv.openai,
        )  # fmt: skip


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
