"""What the front's handlers share: the engine client, tokenizer, limits and services, set up by
the app's lifespan once the engine is ready."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ..common import Limits
from ..config import ServerConfig
from ..errors import ServiceUnavailable
from .engine_client import EngineClient
from .generation import GenerationService
from .metrics import Metrics
from .openai_api import OpenAIServing
from .session_store import SessionStore


@dataclass
class ServerState:
    cfg: ServerConfig
    metrics: Metrics
    client: EngineClient | None = None
    tokenizer: Any = None
    name: str = ""
    started: float = 0.0
    limits: Limits | None = None
    gen: GenerationService | None = None
    openai: OpenAIServing | None = None
    sessions: SessionStore | None = None
    draining: bool = False

    def live_client(self) -> EngineClient:
        """The engine client, or 503 while shutting down / (re)starting."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")
        if self.client is None or not self.client.alive():
            raise ServiceUnavailable("the engine is not ready; retry shortly", code="engine_not_ready")
        return self.client


def state(request: Request) -> ServerState:
    return request.app.state.server
