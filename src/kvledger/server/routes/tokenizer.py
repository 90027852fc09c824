"""The tokenizer endpoints, in vLLM's and SGLang's shapes: ``POST /tokenize`` (a prompt or chat
messages through the chat template) and ``POST /detokenize``. Nothing reaches the engine."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...common.validation import validate_input_ids
from ...errors import ValidationError
from ..handlers import parse_body
from ..protocol import ChatRequest, DetokenizeRequest, TokenizeRequest
from ..state import state

router = APIRouter()


async def _prepare(request: Request, body_type):
    srv = state(request)
    srv.live_client()
    body = await parse_body(request, body_type)
    srv.openai.check_model(body.model)
    if srv.tokenizer is None:
        raise ValidationError("this model has no tokenizer", param="model", code="no_tokenizer")
    return srv, body, srv.tokenizer


@router.post("/tokenize")
async def tokenize(request: Request):
    srv, body, tok = await _prepare(request, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise ValidationError("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        chat = ChatRequest(
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        ids = srv.openai.chat_input(chat)
    else:
        ids = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    return {"count": len(ids), "max_model_len": srv.limits.context_length, "tokens": ids}


@router.post("/detokenize")
async def detokenize(request: Request):
    srv, body, tok = await _prepare(request, DetokenizeRequest)
    if body.tokens:  # the ids are checked as any prompt's are (integers in the vocabulary)
        validate_input_ids(body.tokens, srv.limits, param="tokens")
    return {"prompt": tok.decode(body.tokens)}
