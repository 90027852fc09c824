"""Streaming sessions: ``/open_session`` and ``/close_session`` (turns go through /generate)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...errors import ValidationError
from ..handlers import parse_body
from ..protocol import CloseSessionBody, OpenSessionBody
from ..state import state

router = APIRouter()


@router.post("/open_session")
async def open_session(request: Request):
    client = state(request).live_client()
    body = await parse_body(request, OpenSessionBody)
    if not body.streaming:
        raise ValidationError("only streaming sessions are supported", param="streaming")
    return await client.call("open_session", session_id=body.session_id, timeout=body.timeout)


@router.post("/close_session")
async def close_session(request: Request):
    client = state(request).live_client()
    body = await parse_body(request, CloseSessionBody)
    await client.call("close_session", session_id=body.session_id)
    return {"success": True}
