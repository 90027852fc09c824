"""The engine process: an ``EngineCore`` (built by ``build.start_engine``) driven by a loop that talks to the HTTP front over ZMQ.

Messages are the typed structs of ``common/messages.py`` (JSON, never pickle: request data comes
from clients) over Unix-domain IPC sockets in a private (0700) directory. The front binds, the engine
connects, one socket pair per engine generation so that a restarted engine never receives messages
meant for a dead one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import msgspec

from ..common import messages as m
from ..config import EngineConfig
from ..errors import KVLedgerError, ValidationError
from ..multimodal.inputs import from_wire
from ..testing import faults
from .build import start_engine

log = logging.getLogger("kvledger.engine")

STATS_INTERVAL_S = 0.5


class _Loop:
    """Receive, step, send. One instance per engine process."""

    def __init__(self, core, pull, push):
        self.core, self.pull, self.push = core, pull, push
        self.on_add = faults.engine_process_hook()  # None unless a fault test asked for one
        self.last_stats = 0.0

    def send(self, msg: msgspec.Struct) -> None:
        self.push.send(m.encode(msg))

    def handle(self, msg) -> bool:
        """Act on one message; False on shutdown."""
        core = self.core
        if isinstance(msg, m.AddRequest):
            if self.on_add is not None:
                self.on_add(msg.rid)
            req = None
            try:
                mm = from_wire(msg.images) if msg.images else None
                req = core.make_request(msg.input_ids, msg.sampling, msg.rid, msg.pooling, mm)
                req.disagg = msg.disagg
                core.submit(req, msg.session_params)
            except KVLedgerError as e:
                if req is not None:
                    core.drop_request(req)  # (its grammar may be compiling)
                self.send(m.Outputs([core.reject(msg.rid, e)]))
        elif isinstance(msg, m.AbortRequest):
            core.abort(msg.rid, msg.message)
        elif isinstance(msg, m.Call):
            self.send(_call(core, msg))
        elif isinstance(msg, m.Shutdown):
            n = core.control.shutdown()
            log.info("engine shut down: %d session(s) closed", n)
            return False
        return True

    def run(self) -> None:
        import zmq

        was_busy = False
        while True:
            s = self.core.scheduler
            # Idle, or paused with nothing in transfer: wait for a message (a paused engine still
            # steps to take in aborts and timeouts). Only waiting on KV (a transfer, an async
            # save): check back soon, without spinning a core. Computing: just look.
            resting = s.idle or (s.paused is not None and not s.has_pending_kv)
            wait_ms = 50 if resting else (0 if self.core.last_step_ran else 2)
            if self.pull.poll(wait_ms):
                while True:
                    try:
                        frame = self.pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = m.decode_to_engine(frame)
                    except msgspec.ValidationError as e:  # a malformed frame is logged, not fatal
                        log.error("dropped a malformed message: %s", e)
                        continue
                    if not self.handle(msg):
                        return
            now = time.monotonic()
            if self.core.scheduler.idle and not was_busy and not self.core.scheduler.has_outputs:
                if now - self.last_stats > STATS_INTERVAL_S:  # the heartbeat the watchdog listens for
                    self.last_stats = now
                    self.send(m.Outputs([], self.core.view.stats()))
                continue
            outs = self.core.step()
            now = time.monotonic()
            was_busy = not self.core.scheduler.idle
            # The ledger figures walk every live request: a few times a second is enough for gauges,
            # and always once when the engine goes idle (gauges drop to 0 after a mass abort).
            stats = None
            if not was_busy or now - self.last_stats > STATS_INTERVAL_S / 5:
                self.last_stats = now
                stats = self.core.view.stats()
            self.send(m.Outputs(outs, stats))


def engine_main(cfg_dict: dict, ipc_dir: str, generation: int, log_level: str = "INFO") -> None:
    """Entry point of the engine process."""
    import zmq

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s engine: %(message)s")
    from ..parallel.worker import die_with_parent

    die_with_parent()  # a front killed outright (SIGKILL) must not leave its engine behind
    if os.getppid() == 1:  # it died before the line above
        return
    to_engine, from_engine = m.ipc_paths(ipc_dir, generation)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    for sock, path in ((pull, to_engine), (push, from_engine)):
        # An engine started before its front's event loop (``server/early_engine.py``) connects
        # before the front binds: retried every 20 ms (ZMQ's default: 100), what it sends queued.
        sock.setsockopt(zmq.RECONNECT_IVL, 20)
        sock.connect(path)
    try:
        core = start_engine(EngineConfig.from_flat(**cfg_dict))
    except KVLedgerError as e:
        push.send(m.encode(m.Fatal(e.message)))
        time.sleep(0.2)
        return
    ready = m.Ready(os.getpid(), core.view.info_dict(), dataclasses.asdict(core.limits), core.cfg.flat())
    push.send(m.encode(ready))
    _Loop(core, pull, push).run()


def _call(core, msg: m.Call) -> m.Reply:
    """Control operations from the front; errors travel back in the OpenAI shape with their status."""
    args = msg.args
    ctl, view = core.control, core.view
    ops = {
        "flush_cache": ctl.flush_cache,
        "memory": view.memory,
        "audit": lambda: view.audit().describe(),
        "page_map": view.page_map,
        "open_session": lambda: ctl.open_session(args.get("session_id"), args.get("timeout")),
        "close_session": lambda: ctl.close_session(args.get("session_id")) or True,
        "restore_sessions": lambda: ctl.restore_sessions(args.get("sessions") or []),
        "sessions": core.sessions.describe,
        "pause_generation": lambda: ctl.pause_generation(args.get("mode")),
        "continue_generation": lambda: ctl.continue_generation() or True,
        "update_weights_from_disk": lambda: ctl.update_weights_from_disk(args.get("model_path"), args.get("load_format")),
        "load_lora_adapter": lambda: ctl.load_lora_adapter(args.get("lora_name"), args.get("lora_path")),
        "unload_lora_adapter": lambda: ctl.unload_lora_adapter(args.get("lora_name")) or True,
        "lora_list": view.lora_list,
    }
    try:
        op = ops.get(msg.op)
        if op is None:
            raise ValidationError(f"unknown operation {msg.op!r}")
        return m.Reply(msg.id, op())
    except KVLedgerError as e:
        return m.Reply(msg.id, error={**e.to_dict()["error"], "status": e.status})
