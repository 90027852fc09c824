"""LoRA adapters at run time, SGLang's and vLLM's shapes: ``POST /load_lora_adapter`` (``lora_name``,
``lora_path``) and ``POST /unload_lora_adapter`` (``lora_name``). Admin paths (``auth.py``). The
answer is SGLang's ``{success, message, loaded_adapters}``; a failure also carries the OpenAI error
object, with its status (400 an adapter this server cannot serve or a name already loaded, 404 a
name not loaded, 409 unloading an adapter that queued or running requests use).

The front's list of adapters (``/v1/models``, the OpenAI ``model`` field) is the engine's, kept in
``client.info``; each change also goes into the settings a restarted engine starts from, so an
adapter loaded here survives an engine restart."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...config import EngineConfig
from ...errors import KVLedgerError
from ..handlers import parse_body
from ..protocol import LoadLoraBody, UnloadLoraBody
from ..state import state

router = APIRouter()
LOAD_CALL_S = 120.0  # reading an adapter's files


def _answer(client, message: str) -> dict:
    loaded = {a["name"]: a["path"] for a in client.info.get("loras") or []}
    return {"success": True, "message": message, "loaded_adapters": loaded}


def _failed(e: KVLedgerError) -> JSONResponse:
    return JSONResponse({"success": False, "message": e.message, **e.to_dict()}, status_code=e.status)


def _set_paths(client, loras: list[dict]) -> None:
    """The front's list and the restart settings after a change."""
    client.info["loras"] = loras
    flat = client.cfg.flat()
    flat.update(lora_paths=[f"{a['name']}={a['path']}" for a in loras] or None, enable_lora=True)
    client.cfg = EngineConfig.from_flat(**flat)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request):
    srv = state(request)
    client = srv.live_client()
    body = await parse_body(request, LoadLoraBody)
    try:
        info = await client.call("load_lora_adapter", LOAD_CALL_S, blocking=True, lora_name=body.lora_name,
                                 lora_path=body.lora_path)  # fmt: skip
    except KVLedgerError as e:
        return _failed(e)
    _set_paths(client, [*(client.info.get("loras") or []), info])
    return _answer(client, f"LoRA adapter {body.lora_name!r} loaded from {body.lora_path}.")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    srv = state(request)
    client = srv.live_client()
    body = await parse_body(request, UnloadLoraBody)
    try:
        await client.call("unload_lora_adapter", lora_name=body.lora_name)
    except KVLedgerError as e:
        return _failed(e)
    _set_paths(client, [a for a in client.info.get("loras") or [] if a["name"] != body.lora_name])
    return _answer(client, f"LoRA adapter {body.lora_name!r} unloaded.")
