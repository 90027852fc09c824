"""Generation control for RL trainers, SGLang's shapes: ``/pause_generation`` (mode abort | retract |
in_place), ``/continue_generation``, ``/update_weights_from_disk``. Admin paths (``auth.py``); the
order of operations is ``server/control.py``'s."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...errors import KVLedgerError
from ..handlers import parse_body
from ..protocol import ContinueGenerationBody, PauseGenerationBody, UpdateWeightsBody
from ..state import state

router = APIRouter()


@router.post("/pause_generation")
async def pause_generation(request: Request):
    """A JSON body is required (``{}`` pauses with SGLang's default mode, abort): an empty POST
    stops nothing."""
    srv = state(request)
    srv.live_client()
    body = await parse_body(request, PauseGenerationBody)
    held = await srv.control.pause(body.mode)
    message = "Generation paused successfully."
    return {"message": message, "status": "ok", "mode": body.mode, "num_paused_requests": held}


@router.post("/continue_generation")
async def continue_generation(request: Request):
    srv = state(request)
    srv.live_client()
    if (await request.body()).strip():  # no body is {}: continuing is never harmful
        await parse_body(request, ContinueGenerationBody)
    await srv.control.resume()
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    """SGLang's answer, ``{success, message, num_paused_requests}``; a failure also carries the
    OpenAI error object, with its status (400 a path or checkpoint that cannot replace the running
    one, 409 requests holding KV of the current weights)."""
    srv = state(request)
    srv.live_client()
    body = await parse_body(request, UpdateWeightsBody)
    try:
        n = await srv.control.update_weights(body.model_path, body.load_format, body.abort_all_requests)
    except KVLedgerError as e:
        content = {"success": False, "message": e.message, "num_paused_requests": 0, **e.to_dict()}
        return JSONResponse(content, status_code=e.status)
    message = f"Succeeded to update model weights from {body.model_path}."
    return {"success": True, "message": message, "num_paused_requests": n}
