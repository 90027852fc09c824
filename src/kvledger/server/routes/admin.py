"""Operations and health: ``/abort_request``, ``/flush_cache``, ``/get_server_info``, ``/health``,
``/health_generate``, ``/metrics``."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ...common import validate_request
from ...common.health import HEALTH_CHECK_IDS, HEALTH_CHECK_SAMPLING, health_check_disagg
from ...errors import ConflictError, NotFoundError, PermissionDenied
from ...version import __version__
from .. import auth
from ..handlers import error_response, parse_body
from ..protocol import RidBody
from ..state import state

router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 60
SECRET = "***"
SECRET_SETTINGS = ("hicache_salt",)  # engine settings shown masked (a salt keys other tenants' pages)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@router.post("/abort_request")
async def abort_request(request: Request):
    srv = state(request)
    client = srv.live_client()
    body = await parse_body(request, RidBody)
    if body.rid not in client.streams:
        raise NotFoundError(f"no running request with id {body.rid!r}", param="rid", code="rid_not_found")
    if not auth.may_abort(auth.current_principal(), srv.gen.owners.get(body.rid)):
        raise PermissionDenied(
            "only the admin key may abort another key's request", param="rid", code="not_request_owner"
        )
    await client.abort(body.rid, "aborted by /abort_request")
    return {"success": True}


@router.post("/flush_cache")
async def flush_cache(request: Request):
    client = state(request).live_client()
    if client.streams or not await client.call("flush_cache"):
        raise ConflictError("requests are running; flush the cache when the server is idle", code="busy")
    return {"success": True}


@router.get("/get_server_info")
@router.get("/server_info")  # the name SGLang's router asks for when it registers a worker
async def server_info(request: Request):
    srv = state(request)
    client = srv.live_client()
    server = dataclasses.asdict(srv.cfg)
    server.pop("engine", None)
    for key in ("api_key", "admin_api_key"):  # (not even how many keys there are)
        server[key] = SECRET if server[key] else None
    engine_config = dict(client.engine_config)
    for key in SECRET_SETTINGS:
        if engine_config.get(key) is not None:
            engine_config[key] = SECRET
    sessions = await client.call("sessions")
    info = {
        "version": __version__,
        "model": srv.name,
        "model_path": client.info.get("model_path"),
        "engine": client.info,
        "engine_config": engine_config,
        "server_config": server,
        "memory": await client.call("memory"),
        "session_counts": _session_counts(sessions),
        "generation_paused": srv.gate.paused,  # the pause mode, or None
        "engine_restarts": client.restarts,
        "engine_pid": client.pid,
        "server_pid": os.getpid(),
        "served_model_name": srv.name,
        "reasoning_parser": srv.cfg.engine.model.reasoning_parser,  # SGLang's server_args name
        "tool_call_parser": srv.cfg.tool_call_parser,
        "dp_size": 1,
        "disaggregation_mode": client.info.get("disaggregation_mode") or "null",
        "disaggregation": (client.stats or {}).get("disagg"),
        "vision": (client.stats or {}).get("vision"),  # images encoded, tower calls, encoder-cache hits
    }
    # Session ids only where no key is configured: there everyone may read /memory/pages, which shows
    # them. With keys, no key sees one here (counts only); the admin sees them on /memory/pages.
    if srv.keys.open:
        info["sessions"] = sessions
    return info


def _session_counts(sessions: list[dict]) -> dict:
    return {
        "open": len(sessions),
        "busy": sum(s["busy_rid"] is not None for s in sessions),
        "closing": sum(bool(s["closing"]) for s in sessions),
        "held_tokens": sum(s["held_tokens"] for s in sessions),
    }


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request):
    """What SGLang's router reads of a worker's model (its mini load balancer uses the old name)."""
    srv = state(request)
    info = srv.live_client().info
    arch = info.get("arch", "llama")
    return {
        "model_path": info.get("model_path"),
        "tokenizer_path": info.get("model_path"),
        "served_model_name": srv.name,
        "is_generation": True,
        "model_type": arch,
        "architectures": [ARCHITECTURES.get(arch, "LlamaForCausalLM")],
    }


@router.get("/get_load")
async def get_load(request: Request):
    """SGLang's load shape, one entry per data-parallel rank (one here), from the engine's latest
    figures (no call into the engine)."""
    client = state(request).live_client()
    stats = client.stats or {}
    m = stats.get("memory") or {}
    used = m.get("kv_total", 0) - m.get("kv_free", 0) - m.get("kv_cached_evictable", 0)
    return [
        {
            "dp_rank": 0,
            "num_reqs": stats.get("num_running", 0),
            "num_waiting_reqs": stats.get("num_waiting", 0),
            "num_tokens": used,
            "ts_tic": stats.get("time", 0.0),
        }
    ]


@router.get("/health")
async def health(request: Request):
    """Cheap liveness of the front and the engine: 503 while the engine is starting, restarting or
    dead, and while its current step has run past the stall limit (half of --watchdog-timeout), so
    a stuck engine is reported before (and without) the watchdog killing it."""
    client = state(request).client
    if client is None or not client.alive():
        return error_response(503, "the engine is not ready", "service_unavailable", code="engine_not_ready")
    stuck = client.stalled_for()
    if stuck is not None:
        return error_response(
            503,
            f"the engine's step has not ended for {stuck:.1f} s (a step may take {client.stall_limit_s:g} s)",
            "service_unavailable",
            code="engine_stalled",
        )
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request):
    """A real 1-token generation through the engine and its one release path (``common/health.py``:
    on a PD server with SGLang's fake bootstrap room)."""
    srv = state(request)
    client = srv.live_client()
    if srv.gate.closed:
        # Paused by an operator, or loading weights: a generation would wait for the continue.
        # The engine answering a control call (after the update, if one runs) is its liveness.
        await client.call("memory", HEALTH_GENERATE_TIMEOUT_S)
        return Response(status_code=200)
    ids, params = validate_request(list(HEALTH_CHECK_IDS), dict(HEALTH_CHECK_SAMPLING), srv.limits)
    rid = f"health-{uuid.uuid4().hex}"
    fake = health_check_disagg(bool(client.info.get("disaggregation_mode")))
    try:
        st = await asyncio.wait_for(
            srv.gen.collect(ids, params, rid, request.is_disconnected, owner=auth.INTERNAL, disagg=fake),
            HEALTH_GENERATE_TIMEOUT_S,
        )
    except TimeoutError:
        return error_response(503, "the engine did not answer in time", "service_unavailable")
    if st.error() is not None:
        return error_response(503, f"health generation failed: {st.finish.message}", "service_unavailable")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request):
    return Response(state(request).metrics.render(), media_type="text/plain; version=0.0.4")
