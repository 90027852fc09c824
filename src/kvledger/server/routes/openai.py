"""The OpenAI API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/v1/models``;
``/v1/embeddings`` and the pooling peers' ``/v1/score`` and ``/v1/rerank``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ...errors import ValidationError
from ..handlers import parse_body
from ..protocol import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
)
from ..state import state

router = APIRouter()


async def _serve(request: Request, body_type, method: str, api: str = "openai"):
    srv = state(request)
    srv.live_client()
    body = await parse_body(request, body_type)
    result = await getattr(getattr(srv, api), method)(body, request.is_disconnected)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


@router.post("/v1/completions")
async def completions(request: Request):
    return await _serve(request, CompletionRequest, "completions")


@router.post("/v1/chat/completions")
async def chat(request: Request):
    return await _serve(request, ChatRequest, "chat")


@router.post("/v1/responses")
async def create_response(request: Request):
    return await _serve(request, ResponsesRequest, "create", api="responses")


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    return await _serve(request, EmbeddingRequest, "embeddings", api="pooling")


@router.post("/v1/score")
async def score(request: Request):
    return await _serve(request, ScoreRequest, "score", api="pooling")


@router.post("/v1/rerank")
async def rerank(request: Request):
    return await _serve(request, RerankRequest, "rerank", api="pooling")


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str):
    """A stored response (``store`` true, still among the last ``--max-stored-responses``); 404 otherwise."""
    srv = state(request)
    srv.live_client()
    return JSONResponse(srv.responses.retrieve(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    """Forget a stored response (404 if it is not stored)."""
    srv = state(request)
    srv.live_client()
    return JSONResponse(srv.responses.delete(response_id))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str):
    """OpenAI's cancel stops a response created with ``background: true``; this server runs none in
    the background (refused at create), so a stored response is a 400, as OpenAI answers for a
    synchronous one, and an unknown one a 404."""
    srv = state(request)
    srv.live_client()
    srv.responses.retrieve(response_id)
    raise ValidationError(
        "cannot cancel a synchronous response: only a response created with background: true can be "
        "cancelled, and this server runs none in the background",
        param="response_id", code="response_not_cancellable",
    )  # fmt: skip


def model_card(request: Request) -> dict:
    """The served model as OpenAI's model object, with vLLM's extra fields."""
    srv = state(request)
    return {
        "id": srv.name,
        "object": "model",
        "created": int(srv.started),
        "owned_by": "kvledger",
        # vLLM's extra fields: the context length, and what the served name stands for (vLLM writes
        # the model's path there; no answer here shows a path on the server's disk: the served name).
        "max_model_len": srv.limits.context_length,
        "root": srv.name,
        "parent": None,
        # How its reasoning is answered (--reasoning-parser; None: left in content).
        "reasoning_parser": srv.cfg.engine.model.reasoning_parser,
        # What the other endpoints do with this model: tool calls' format, how /v1/embeddings and
        # /v1/rerank pool, whether a request's priority orders the queue.
        "tool_call_parser": srv.cfg.tool_call_parser,
        "pooling": srv.cfg.pooling,
        "priority_scheduling": srv.cfg.engine.scheduler.enable_priority_scheduling,
    }


@router.get("/v1/models")
async def models(request: Request):
    """The served model, then its LoRA adapters (each a model whose ``parent`` is the base)."""
    return {"object": "list", "data": [model_card(request), *map(lora_card(request), _adapters(request))]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str):
    """OpenAI's retrieve: the served model by its name or an alias, or an adapter; 404 otherwise."""
    lora = state(request).openai.check_model(model, adapters=True)
    if lora is not None:
        return lora_card(request)(next(a for a in _adapters(request) if a["name"] == lora))
    return model_card(request)


def _adapters(request: Request) -> list[dict]:
    client = state(request).client
    return list(client.info.get("loras") or []) if client else []


def lora_card(request: Request):
    """A LoRA adapter as an OpenAI model object (vLLM's shape, ``parent`` the base; ``root`` its name,
    where vLLM writes the adapter's path: no answer shows a path on the server's disk)."""
    srv = state(request)

    def card(a: dict) -> dict:
        return {"id": a["name"], "object": "model", "created": int(srv.started), "owned_by": "kvledger",
                "max_model_len": srv.limits.context_length, "root": a["name"], "parent": srv.name}  # fmt: skip

    return card
