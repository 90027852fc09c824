"""Streaming sessions: ``/open_session`` and ``/close_session`` (turns go through /generate)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...errors import NotFoundError, ValidationError
from ..handlers import parse_body
from ..protocol import CloseSessionBody, OpenSessionBody
from ..state import state

router = APIRouter()


@router.post("/open_session")
async def open_session(request: Request):
    srv = state(request)
    client = srv.live_client()
    body = await parse_body(request, OpenSessionBody)
    if not body.streaming:
        raise ValidationError("only streaming sessions are supported", param="streaming")
    sid = await client.call("open_session", session_id=body.session_id, timeout=body.timeout)
    srv.sessions.opened(sid, body.timeout)
    return sid


@router.post("/close_session")
async def close_session(request: Request):
    srv = state(request)
    client = srv.live_client()
    body = await parse_body(request, CloseSessionBody)
    try:
        await client.call("close_session", session_id=body.session_id)
    except NotFoundError:
        srv.sessions.closed(body.session_id)  # unknown to the engine: nothing to restore either
        raise
    srv.sessions.closed(body.session_id)
    return {"success": True}
