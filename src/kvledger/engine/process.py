"""The engine process: an ``EngineCore`` driven by a loop that talks to the HTTP front over ZMQ.

Messages are JSON (never pickle: request data comes from clients) over Unix-domain IPC sockets in a
private (0700) directory. The front binds, the engine connects, one socket pair per engine
generation so that a restarted engine never receives messages meant for a dead one.

front -> engine: {"type": "add", rid, input_ids, sampling, health}, {"type": "abort", rid, message},
                 {"type": "call", id, op: "flush_cache" | "memory" | "audit"}
engine -> front: {"type": "ready", info, limits, config}, {"type": "fatal", message},
                 {"type": "outputs", items: [StepOutput...], stats}, {"type": "reply", id, result}
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from ..config import EngineConfig
from ..errors import KVLedgerError
from ..scheduler.request import FinishReason, StepOutput

log = logging.getLogger("kvledger.engine")

STATS_INTERVAL_S = 0.5


def output_to_dict(o: StepOutput) -> dict:
    d = dataclasses.asdict(o)
    d["finish_reason"] = None if o.finish_reason is None else dataclasses.asdict(o.finish_reason)
    return d


def error_output(rid: str, e: KVLedgerError, prompt_tokens: int = 0) -> dict:
    fr = FinishReason("abort", e.message, status=e.status)
    d = output_to_dict(StepOutput(rid, [], [], [], True, fr, prompt_tokens, 0, 0))
    d["finish_reason"]["code"] = e.code
    d["finish_reason"]["param"] = e.param
    return d


def ipc_paths(ipc_dir: str, generation: int) -> tuple[str, str]:
    return (f"ipc://{ipc_dir}/to_engine_{generation}", f"ipc://{ipc_dir}/from_engine_{generation}")


def engine_main(cfg_dict: dict, ipc_dir: str, generation: int, log_level: str = "INFO") -> None:
    """Entry point of the engine process."""
    import zmq

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s engine: %(message)s")
    to_engine, from_engine = ipc_paths(ipc_dir, generation)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(to_engine)
    push = ctx.socket(zmq.PUSH)
    push.connect(from_engine)
    try:
        from .core import EngineCore

        core = EngineCore(EngineConfig(**cfg_dict))
    except KVLedgerError as e:
        push.send_json({"type": "fatal", "message": e.message})
        time.sleep(0.2)
        return
    push.send_json(
        {
            "type": "ready",
            "pid": os.getpid(),
            "info": dataclasses.asdict(core.info),
            "limits": dataclasses.asdict(core.limits),
            "config": dataclasses.asdict(core.cfg),
        }
    )
    crash_rid = os.environ.get("KVLEDGER_TEST_CRASH_ON_RID")  # test-only fault injection
    stall_rid = os.environ.get("KVLEDGER_TEST_STALL_RID")
    last_stats = 0.0
    was_busy = False
    while True:
        idle = core.scheduler.idle
        if pull.poll(0 if not idle else 50):
            while True:
                try:
                    msg = pull.recv_json(zmq.NOBLOCK)
                except zmq.Again:
                    break
                kind = msg.get("type")
                if kind == "add":
                    if crash_rid and msg["rid"] == crash_rid:
                        os._exit(17)  # simulate an engine death the front must survive
                    if stall_rid and msg["rid"] == stall_rid:
                        time.sleep(3600)  # simulate a hung step: the front's watchdog must notice
                    try:
                        req = core.make_request(msg["input_ids"], msg["sampling"], msg["rid"])
                        req.is_health_check = bool(msg.get("health"))
                        core.submit(req, msg.get("session_params"))
                    except KVLedgerError as e:
                        push.send_json({"type": "outputs", "items": [error_output(msg["rid"], e)]})
                elif kind == "abort":
                    core.abort(msg["rid"], msg.get("message") or "aborted by the client")
                elif kind == "call":
                    push.send_json(
                        {"type": "reply", "id": msg["id"], **_call(core, msg["op"], msg.get("args") or {})}
                    )
                elif kind == "shutdown":
                    # Everything still running ends through the release path, then sessions close.
                    for rid in list(core.scheduler.reqs):
                        core.abort(rid, "the engine is shutting down")
                    core.scheduler.settle()
                    for sid in list(core.sessions.sessions):
                        core.close_session(sid)
                    log.info("engine shut down")
                    return
        if core.scheduler.idle and not was_busy:
            now = time.monotonic()
            if now - last_stats > STATS_INTERVAL_S:
                last_stats = now
                push.send_json({"type": "outputs", "items": [], "stats": _stats(core)})
            continue
        outs = core.step()
        was_busy = not core.scheduler.idle
        msg: dict = {"type": "outputs", "items": [output_to_dict(o) for o in outs]}
        now = time.monotonic()
        # The ledger figures walk every live request: a few times a second is enough for gauges,
        # and always once when the engine goes idle (gauges drop to 0 after a mass abort).
        if not was_busy or now - last_stats > STATS_INTERVAL_S / 5:
            last_stats = now
            msg["stats"] = _stats(core)
        push.send_json(msg)


def _call(core, op: str, args: dict) -> dict:
    """Control operations from the front; errors travel back in the OpenAI shape with their status."""
    try:
        if op == "flush_cache":
            result = core.flush_cache()
        elif op == "memory":
            result = core.memory()
        elif op == "audit":
            result = core.audit().describe()
        elif op == "open_session":
            result = core.open_session(args.get("session_id"), args.get("timeout"))
        elif op == "close_session":
            core.close_session(args.get("session_id"))
            result = True
        elif op == "sessions":
            result = core.sessions.describe()
        else:
            return {"error": {"message": f"unknown operation {op!r}", "status": 400}}
    except KVLedgerError as e:
        return {"error": {**e.to_dict()["error"], "status": e.status}}
    return {"result": result}


def _stats(core) -> dict:
    s = core.scheduler
    return {
        "num_running": len(s.running),
        "num_waiting": len(s.waiting),
        "retractions": s.total_retractions,
        "num_sessions": len(core.sessions.sessions),
        "memory": core.memory(),
        "time": time.time(),
    }
