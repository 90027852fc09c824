"""What the front's handlers share: the engine client, tokenizer, limits and services, set up by
the app's start (``create_app``) once the engine is ready."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..common import Limits
from ..config import ServerConfig
from ..errors import ServiceUnavailable
from .admission import AdmissionLimits
from .auth import DashboardLogins, KeyRing
from .control import Control, GenerationGate
from .engine_client import EngineClient
from .generation import GenerationService
from .metrics import Metrics
from .openai_api import OpenAIServing
from .pooling_api import PoolingServing
from .responses_api import ResponsesServing
from .session_store import SessionStore


@dataclass
class ServerState:
    cfg: ServerConfig
    metrics: Metrics
    keys: KeyRing
    logins: DashboardLogins = field(default_factory=DashboardLogins)  # the dashboard's cookie
    client: EngineClient | None = None
    tokenizer: Any = None
    name: str = ""
    started: float = 0.0
    limits: Limits | None = None
    gen: GenerationService | None = None
    openai: OpenAIServing | None = None
    responses: ResponsesServing | None = None
    pooling: PoolingServing | None = None
    sessions: SessionStore | None = None
    gate: GenerationGate = field(default_factory=GenerationGate)  # paused / updating weights
    control: Control | None = None
    draining: bool = False
    # Set by the first SIGTERM/SIGINT: a start-up in progress stops waiting for the engine.
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    # Not None once the server must stop serving and exit with it (1: the engine cannot be started).
    exit_code: int | None = None
    admission: AdmissionLimits = field(init=False)  # what one body may ask (from cfg)

    def __post_init__(self) -> None:
        c = self.cfg
        self.admission = AdmissionLimits(
            c.max_prompts_per_request, c.max_choices_per_request, c.max_prompt_tokens_per_request,
            c.max_requests_per_key,
        )  # fmt: skip

    def live_client(self) -> EngineClient:
        """The engine client, or 503 while shutting down / (re)starting."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")
        if self.client is None or not self.client.alive():
            raise ServiceUnavailable("the engine is not ready; retry shortly", code="engine_not_ready")
        return self.client


def state(request: Request) -> ServerState:
    return request.app.state.server
