"""The front's settings: ``ServerConfig`` (the HTTP server, its keys and limits, with the engine's
inside) and ``LaunchSettings`` (data-parallel replicas behind SGLang's router)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ValidationError
from .base import (
    POOLINGS,
    ROUTER_POLICIES,
    TOOL_CALL_PARSERS,
    setting,
)
from .engine import EngineConfig


@dataclass
class ServerConfig:
    """Settings of the HTTP front."""

    host: str = setting("127.0.0.1", "the address the HTTP server binds")
    port: int = setting(30000, "the HTTP port")
    api_key: list[str] | None = setting(  # noqa: RUF009 (a declaration: default None)
        None, (
        "one or more user keys, each its own tenant: 'Authorization: Bearer KEY' (not on /health, "
        "/metrics)"
    ), nargs="+", metavar="KEY")
    admin_api_key: str | None = setting(None, (
        "the operator's key: admin paths (page map, /flush_cache, pause, weights, LoRA), aborting "
        "others' requests"
    ))
    admin_open: bool = setting(False, "without --admin-api-key, let user keys use the admin paths (refused otherwise)", kind="switch")
    allowed_origins: list[str] | None = setting(  # noqa: RUF009 (a declaration: default None)
        None, (
        "web origins (scheme://host[:port]) besides the server's own whose browser requests are "
        "accepted (and granted CORS)"
    ), nargs="+", metavar="ORIGIN")
    tool_call_parser: str = setting("hermes", "the model's tool-call format (hermes = qwen: <tool_call> JSON; llama3; mistral)", choices=TOOL_CALL_PARSERS)
    served_model_name: str | None = setting(None, "the model's name in the API (default: the model file's or directory's)")
    log_level: str = setting("info", "the logging level (debug, info, warning, error)")
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest request body, in bytes (413 past it)")
    body_timeout_s: float = setting(30.0, "seconds a request body may take to arrive whole (408 past it: a stalled client holds nothing)", flags=("--body-timeout",))
    max_n: int = setting(16, "largest n (choices per request)")
    # Images (a vision-language model; server/image_parts.py, multimodal/media.py).
    allowed_local_media_path: str | None = setting(None, "image parts may name local files under this directory (file:// or a path; refused otherwise)", metavar="DIR")
    max_images_per_prompt: int = setting(8, "images one request may carry (400 past it)")
    max_image_bytes: int = setting(20 * 1024 * 1024, "largest encoded image, in bytes (400 past it)")
    max_image_pixels: int = setting(4096 * 4096, "largest image in pixels (width x height, read from its header before decoding: 400 past it)")
    allow_remote_media: bool = setting(False, "fetch http(s) image URLs (off: a 400); never from a private, loopback, link-local or reserved address", kind="switch")
    allowed_media_domains: list[str] | None = setting(  # noqa: RUF009 (a declaration: default None)
        None, "with --allow-remote-media, fetch only from these hosts and their subdomains (default: any public host)",
        nargs="+", metavar="DOMAIN")
    media_fetch_timeout_s: float = setting(10.0, "seconds one remote image fetch may take in all: resolving, redirects and body (400 past it)")
    media_max_redirects: int = setting(3, "redirects one remote image fetch may follow, each hop checked like the first (400 past it)")
    # What one body and one caller may ask of the engine (server/admission.py).
    max_prompts_per_request: int = setting(2048, "prompts (inputs, items, documents) one body may carry (400 past it; OpenAI's embeddings limit)")
    max_choices_per_request: int = setting(1024, "engine requests one body may fan out to, prompts x n (400 past it)")
    max_prompt_tokens_per_request: int = setting(1 << 20, "prompt tokens of one body, all its prompts together (400 past it)")
    max_requests_per_key: int = setting(1024, "engine requests one API key (or anonymous) may have in flight (429 past it)")
    max_stored_responses: int = setting(1024, "responses kept for previous_response_id and GET /v1/responses/{id} (an LRU)")
    pooling: str = setting("last", "/v1/embeddings and /v1/rerank: the last token's final hidden state, or the mean of all", choices=POOLINGS)
    watchdog_timeout_s: float = setting(60.0, "restart the engine if a step makes no progress for this long (seconds)", flags=("--watchdog-timeout",))
    grace_period_s: float = setting(10.0, "time running requests get to finish on SIGTERM/SIGINT (seconds)", flags=("--grace-period",))
    session_journal: str | None = setting(None, "keep open sessions in DIR so that they survive a restart of this server", metavar="DIR")
    """A directory where open sessions' committed tokens are kept, so that they survive the server
    process (re-opened on start, KV recomputed); ``--dp-size`` gives each replica one."""
    engine: EngineConfig = field(default_factory=EngineConfig)

    def check(self) -> None:
        """The keys: none empty, and no user key that is also the admin key (a user key is never one)."""
        keys = self.api_key or []
        if any(not k for k in keys) or self.admin_api_key == "":
            raise ValidationError("an API key must not be empty", param="api_key")
        if self.admin_api_key is not None and self.admin_api_key in keys:
            raise ValidationError("--admin-api-key must differ from every --api-key", param="admin_api_key")
        if not self.media_fetch_timeout_s > 0:
            raise ValidationError("--media-fetch-timeout-s must be positive", param="media_fetch_timeout_s")
        if self.media_max_redirects < 0:
            raise ValidationError("--media-max-redirects must be at least 0", param="media_max_redirects")



@dataclass
class LaunchSettings:
    """What ``kvledger serve`` starts besides one server: data-parallel replicas behind SGLang's router."""

    dp_size: int = setting(
        1,
        "start this many replicas (ports --port+1..) behind SGLang's router (--port+N+1, its metrics --port+N+2) and a session "
        "front on --port",
        flags=("--dp-size", "--data-parallel-size"),
    )
    router_policy: str = setting(
        "cache_aware", "--dp-size: the router's load-balancing policy", choices=ROUTER_POLICIES
    )
