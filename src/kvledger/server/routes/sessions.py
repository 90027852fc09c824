"""Streaming sessions: ``/open_session`` and ``/close_session`` (turns go through /generate). A
session is its opener's key's (``session_store.py``): another key closing it gets the 404 of a
session that does not exist."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...errors import NotFoundError, ValidationError
from ..auth import current_principal
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
    srv.sessions.opened(sid, body.timeout, current_principal().owner)
    return sid


@router.post("/close_session")
async def close_session(request: Request):
    srv = state(request)
    client = srv.live_client()
    body = await parse_body(request, CloseSessionBody)
    srv.sessions.check(body.session_id, current_principal().owner, "session_id")
    try:
        await client.call("close_session", session_id=body.session_id)
    except NotFoundError:
        srv.sessions.closed(body.session_id)  # unknown to the engine: nothing to restore either
        raise
    srv.sessions.closed(body.session_id)
    return {"success": True}
