"""The OpenAI API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..handlers import parse_body
from ..protocol import ChatRequest, CompletionRequest
from ..state import state

router = APIRouter()


def _respond(result):
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


@router.post("/v1/completions")
async def completions(request: Request):
    srv = state(request)
    srv.live_client()
    body = await parse_body(request, CompletionRequest)
    return _respond(await srv.openai.completions(body, request.is_disconnected))


@router.post("/v1/chat/completions")
async def chat(request: Request):
    srv = state(request)
    srv.live_client()
    body = await parse_body(request, ChatRequest)
    return _respond(await srv.openai.chat(body, request.is_disconnected))


@router.get("/v1/models")
async def models(request: Request):
    srv = state(request)
    card = {
        "id": srv.name,
        "object": "model",
        "created": int(srv.started),
        "owned_by": "kvledger",
        "max_model_len": srv.limits.context_length,
    }
    return {"object": "list", "data": [card]}
