"""The HTTP front: FastAPI app with SGLang's native API, the OpenAI API, health and metrics.

The engine core runs in its own process (``EngineClient``); this process validates, tokenizes,
detokenizes and streams. Every error, on every endpoint, is ``{"error": {message, type, param,
code}}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import ServerConfig
from ..errors import ConflictError, KVLedgerError, NotFoundError, ValidationError
from ..scheduler import Limits, validate_request
from .engine_client import EngineClient, EngineUnavailable
from .generation import Generator, GenState
from .metrics import Metrics
from .openai_api import OpenAIServing, sse
from .protocol import (
    ChatRequest,
    CloseSessionBody,
    CompletionRequest,
    GenerateRequest,
    OpenSessionBody,
    RidBody,
)

log = logging.getLogger("kvledger.server")

OPEN_PATHS = {"/health", "/metrics"}  # reachable without the API key


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: Any = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status
    )


class BodyLimitMiddleware:
    """413 for bodies over ``limit`` bytes, declared or streamed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = JSONResponse(
            {
                "error": {
                    "message": f"request body over {self.limit} bytes",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "body_too_large",
                }
            },
            status_code=413,
        )
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big(scope, receive, send)
        seen = 0

        async def counting_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return msg

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await too_big(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer KEY`` (or ``x-api-key``) matches; /health and /metrics are open.

    Pure ASGI (not BaseHTTPMiddleware), so handlers still see client disconnects."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        given = auth[7:] if auth.lower().startswith(b"bearer ") else headers.get(b"x-api-key", b"")
        if not hmac.compare_digest(given, self.key):
            resp = error_response(
                401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
            )
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


async def parse_body(request: Request, model: type[BaseModel]):
    """Parse a JSON body whatever its content type (curl -d sends form-urlencoded) into ``model``."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValidationError(f"malformed JSON body: {e}", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except PydanticValidationError as e:
        raise RequestValidationError(e.errors()) from None


def create_app(cfg: ServerConfig) -> FastAPI:
    state: dict[str, Any] = {}
    metrics = Metrics()
    model_name = cfg.served_model_name

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        from ..model.loader import default_model_path, load_tokenizer

        client = EngineClient(cfg.engine, log_level=cfg.log_level, watchdog_timeout_s=cfg.watchdog_timeout_s)
        client.on_stats = metrics.update_engine
        client.on_stall = metrics.watchdog_stalls.inc
        client.on_death = metrics.engine_died
        # Start the engine (model load) and load the tokenizer here in parallel.
        client._spawn()
        client._tasks.append(asyncio.create_task(client._monitor()))
        path = cfg.engine.model or default_model_path()
        tokenizer = await asyncio.to_thread(load_tokenizer, path)
        await client.wait_ready()
        name = model_name or client.info["model_name"]
        if not model_name and cfg.engine.model is None:
            from ..model.loader import DEFAULT_MODEL_NAME

            name = DEFAULT_MODEL_NAME
        state.update(client=client, tokenizer=tokenizer, name=name, started=time.time())
        gen = Generator(client, tokenizer, metrics)
        state["gen"] = gen
        state["limits"] = Limits(**client.limits)
        state["openai"] = OpenAIServing(
            gen, name, {os.path.basename(path), "default"}, state["limits"], tokenizer, cfg.max_n
        )
        log.info("serving %s on http://%s:%d", name, cfg.host, cfg.port)
        yield
        await client.close()

    app = FastAPI(title="kvledger", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_body_bytes)

    if cfg.api_key:
        app.add_middleware(ApiKeyMiddleware, key=cfg.api_key)

    # -- errors ------------------------------------------------------------------------------------------
    @app.exception_handler(KVLedgerError)
    async def kv_error(_: Request, e: KVLedgerError):
        return JSONResponse(e.to_dict(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(
                400,
                f"malformed JSON body: {first.get('ctx', {}).get('error', '')}",
                "invalid_request_error",
                code="invalid_json",
            )
        loc = [str(x) for x in first.get("loc", []) if x not in ("body", "function-after")]
        param = ".".join(loc) or None
        return error_response(
            400,
            f"{param or 'body'}: {first.get('msg', 'invalid value')}",
            "invalid_request_error",
            param=param,
            code="invalid_value",
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), type_)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}", "internal_error")

    def _client() -> EngineClient:
        if state.get("draining"):
            raise EngineUnavailable("the server is shutting down", code="shutting_down")
        client = state.get("client")
        if client is None or not client.alive():
            raise EngineUnavailable("the engine is not ready; retry shortly", code="engine_not_ready")
        return client

    # -- native API ----------------------------------------------------------------------------------------
    def _native_result(st: GenState, return_logprob: bool) -> dict:
        meta: dict[str, Any] = {
            "id": st.rid,
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": len(st.output_ids),
            "cached_tokens": st.cached_tokens,
            "finish_reason": st.finish_for_meta(),
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(st.logprobs, st.output_ids)]
            if st.params.top_logprobs:
                meta["output_top_logprobs"] = [
                    [[lp, t, None] for t, lp in (top or [])] for top in st.top_logprobs
                ]
        return {"text": st.visible, "output_ids": list(st.output_ids), "meta_info": meta}

    @app.post("/generate")
    async def generate(request: Request):
        _client()
        body = await parse_body(request, GenerateRequest)
        sess = body.session_params
        if sess is not None and (
            (body.text is not None and not isinstance(body.text, str))
            or (body.input_ids and isinstance(body.input_ids[0], list))
        ):
            raise ValidationError("a session turn takes a single prompt", param="session_params")
        if (body.text is None) == (body.input_ids is None):
            raise ValidationError("give exactly one of text and input_ids", param="text")
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else body.text
            if not texts or any(not isinstance(t, str) or not t for t in texts):
                raise ValidationError("the prompt is empty", param="text", code="empty_prompt")
            if state["tokenizer"] is None:
                raise ValidationError("this model has no tokenizer; send input_ids", param="text")
            ids_list = [state["tokenizer"].encode(t) for t in texts]
            single = isinstance(body.text, str)
        else:
            single = not (body.input_ids and isinstance(body.input_ids[0], list))
            ids_list = [body.input_ids] if single else body.input_ids
        sp = dict(body.sampling_params or {})
        if body.return_logprob:
            sp["logprobs"] = True
            if body.top_logprobs_num:
                sp["top_logprobs"] = body.top_logprobs_num
        jobs = [validate_request(ids, sp, state["limits"]) for ids in ids_list]
        if not single or len(jobs) != 1:
            if body.stream:
                raise ValidationError("stream takes a single prompt", param="stream")
            base = body.rid or uuid.uuid4().hex
            states = await asyncio.gather(
                *(
                    state["gen"].collect(ids, p, f"{base}-{i}", disconnected=request.is_disconnected)
                    for i, (ids, p) in enumerate(jobs)
                )
            )
            return [_native_result(s, body.return_logprob) for s in states]
        ids, params = jobs[0]
        rid = body.rid or uuid.uuid4().hex
        if body.rid is not None and body.rid in state["client"].streams:
            raise ConflictError(
                f"a request with id {rid!r} is already running", param="rid", code="duplicate_rid"
            )
        if not body.stream:
            st = await state["gen"].collect(
                ids, params, rid, disconnected=request.is_disconnected, session_params=sess
            )
            err = st.error()
            if err is not None:  # an unstreamed answer that failed is an error, partial output or not
                raise err
            return _native_result(st, body.return_logprob)
        agen = state["gen"].stream(ids, params, rid, session_params=sess)
        first = await agen.__anext__()  # errors before any output become a proper status code
        err = first.error()
        if err is not None and not first.output_ids:
            raise err

        async def events():
            try:
                st = first
                yield sse(_native_result(st, body.return_logprob))
                async for st in agen:
                    err = st.error()
                    if err is not None and not st.output_ids:
                        yield sse(err.to_dict())
                    else:
                        yield sse(_native_result(st, body.return_logprob))
                yield "data: [DONE]\n\n"
            finally:
                await agen.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- OpenAI API ----------------------------------------------------------------------------------------
    async def _openai(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        _client()
        body = await parse_body(request, CompletionRequest)
        return await _openai(await state["openai"].completions(body, request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        _client()
        body = await parse_body(request, ChatRequest)
        return await _openai(await state["openai"].chat(body, request.is_disconnected))

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state["name"],
                    "object": "model",
                    "created": int(state["started"]),
                    "owned_by": "kvledger",
                    "max_model_len": state["limits"].context_length,
                }
            ],
        }

    # -- control ---------------------------------------------------------------------------------------------
    @app.post("/abort_request")
    async def abort_request(request: Request):
        client = _client()
        body = await parse_body(request, RidBody)
        if body.rid not in client.streams:
            raise NotFoundError(f"no running request with id {body.rid!r}", param="rid", code="rid_not_found")
        await client.abort(body.rid, "aborted by /abort_request")
        return {"success": True}

    @app.post("/flush_cache")
    async def flush_cache():
        client = _client()
        if client.streams or not await client.call("flush_cache"):
            raise ConflictError("requests are running; flush the cache when the server is idle", code="busy")
        return {"success": True}

    @app.post("/open_session")
    async def open_session(request: Request):
        client = _client()
        body = await parse_body(request, OpenSessionBody)
        if not body.streaming:
            raise ValidationError("only streaming sessions are supported", param="streaming")
        return await client.call("open_session", session_id=body.session_id, timeout=body.timeout)

    @app.post("/close_session")
    async def close_session(request: Request):
        client = _client()
        body = await parse_body(request, CloseSessionBody)
        await client.call("close_session", session_id=body.session_id)
        return {"success": True}

    @app.get("/get_server_info")
    async def server_info():
        client = _client()
        memory = await client.call("memory")
        server = dataclasses.asdict(cfg)
        server.pop("engine", None)
        server["api_key"] = "***" if cfg.api_key else None
        return {
            "version": __version__,
            "model": state["name"],
            "model_path": client.info.get("model_path"),
            "engine": client.info,
            "engine_config": client.engine_config,
            "server_config": server,
            "memory": memory,
            "sessions": await client.call("sessions"),
            "engine_restarts": client.restarts,
            "engine_pid": client.pid,
        }

    @app.get("/health")
    async def health():
        client = state.get("client")
        if client is None or not client.alive():
            return error_response(
                503, "the engine is not ready", "service_unavailable", code="engine_not_ready"
            )
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        client = _client()
        bos = client.info.get("vocab_size", 2) and 1
        ids, params = validate_request([bos], {"max_new_tokens": 1, "temperature": 0}, state["limits"])
        try:
            st = await asyncio.wait_for(
                state["gen"].collect(
                    ids,
                    params,
                    f"health-{uuid.uuid4().hex}",
                    health=True,
                    disconnected=request.is_disconnected,
                ),
                60,
            )
        except TimeoutError:
            return error_response(503, "the engine did not answer in time", "service_unavailable")
        if st.error() is not None:
            return error_response(
                503, f"health generation failed: {st.finish.get('message')}", "service_unavailable"
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def drain() -> None:
        """Graceful shutdown: refuse new work (503), give running requests ``grace_period_s`` to
        finish, then abort the rest (they end with finish_reason abort and a clear message)."""
        state["draining"] = True
        client: EngineClient | None = state.get("client")
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
    app.state.kv = state
    app.state.metrics = metrics
    return app
