"""The control verbs of an engine, run between steps: sessions, LoRA adapters, pause and continue,
weight updates, the prefix cache's flush, and shutdown. Each settles a launched step first where it
needs the books still (``EngineCore.settle_in_flight``); every request still ends through the one
release path (``Scheduler``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..errors import ConflictError, ModelLoadError, ValidationError
from ..model.lora_adapter import read_adapter
from ..scheduler import PAUSE_MODES
from .weights import check_reload_supported, load_replacement

log = logging.getLogger("kvledger.engine.core")

# How long a shutdown steps to let running work end before it closes anyway.
SHUTDOWN_DRAIN_S = 60.0


class EngineControl:
    """The verbs of one ``EngineCore`` (``core.control``; the core is named, not imported: it builds
    its control). ``rebuild_model``: a checkpoint's model on this rank's communicator (the
    composition root's, ``launch/build.py``), for weight updates."""

    def __init__(self, core, rebuild_model: Callable):
        self.core = core
        self.rebuild_model = rebuild_model

    # -- sessions ---------------------------------------------------------------------------------------
    def open_session(self, session_id: str | None = None, timeout: float | None = None) -> str:
        return self.core.sessions.open(session_id, timeout)

    def close_session(self, session_id: str) -> None:
        self.core.sessions.close(session_id)

    def restore_sessions(self, records: list[dict]) -> int:
        """Re-open a previous engine's sessions from their tokens (``server/session_store.py``)."""
        limits = self.core.limits
        return self.core.sessions.restore(records, limits.vocab_size, limits.context_length)

    # -- LoRA adapters ----------------------------------------------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Read and serve the adapter at ``lora_path`` as ``lora_name`` (400: not servable, a name
        already loaded; nothing changes then)."""
        loras = self.core.loras
        if loras is None:
            raise ValidationError("this server does not serve LoRA adapters: start it with --enable-lora",
                                  param="lora_name", code="lora_disabled")  # fmt: skip
        if not isinstance(lora_name, str) or not lora_name or "=" in lora_name or len(lora_name) > 256:
            raise ValidationError("lora_name must be a non-empty name without '='", param="lora_name")
        if not isinstance(lora_path, str) or not lora_path:
            raise ValidationError("lora_path must be a path", param="lora_path")
        if lora_name in loras.adapters:
            raise ValidationError(f"a LoRA adapter named {lora_name!r} is loaded already", param="lora_name",
                                  code="lora_exists")  # fmt: skip
        adapter = read_adapter(lora_name, lora_path, loras.max_rank)
        loras.add(adapter)
        log.info("LoRA adapter %s loaded from %s (rank %d)", lora_name, lora_path, adapter.rank)
        return adapter.info()

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving ``lora_name``: refused (409) while any request of it is queued or running
        (unload after they end, or abort them); 404 for a name not loaded. Its cached KV stays in
        the prefix cache under its fingerprint (evicted as any), found again if the same files are
        loaded again."""
        core = self.core
        core.lora_adapter(lora_name)
        core.scheduler.settle()  # requests already marked to end go first
        users = [r.rid for r in core.scheduler.reqs.values() if r.params.lora_path == lora_name]
        if users:
            raise ConflictError(
                f"{len(users)} request(s) still use LoRA adapter {lora_name!r}; unload it after they end",
                param="lora_name", code="lora_busy",
            )  # fmt: skip
        core.loras.remove(lora_name)
        log.info("LoRA adapter %s unloaded", lora_name)

    # -- pause and weight updates (RL trainers) ---------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> int:
        """Stop computing until ``continue_generation`` (``Scheduler.pause`` for the modes); requests
        that arrive meanwhile wait in the queue. Returns how many requests are held paused."""
        if mode not in PAUSE_MODES:
            raise ValidationError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
        self.core.settle_in_flight()
        return self.core.scheduler.pause(mode)

    def continue_generation(self) -> None:
        self.core.scheduler.resume()

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> dict:
        """Replace the weights with the checkpoint at ``model_path`` (same architecture and shapes,
        ``weights.py``) without a restart. Refused (409) while any request holds KV: computed by
        the old weights, it would be mixed with the new ones (pause with ``retract`` or ``abort``
        first, or let the requests finish). On success the prefix cache is flushed and every
        session's KV dropped (their tokens stay: the next turn recomputes), through the pools'
        books; requests paused by retraction recompute with the new weights when generation
        continues. Any failure leaves the old weights serving, and nothing changed."""
        core = self.core
        check_reload_supported(core.cfg)
        s = core.scheduler
        core.settle_in_flight()
        s.settle()  # requests already marked (a pause with mode abort) end first
        held = len(s.running) + len(s.waiting_for_kv) + len(s.sending)
        if held:
            raise ConflictError(
                f"{held} request(s) hold KV computed by the current weights; pause generation with "
                f"mode retract or abort first, or let them finish",
                code="busy",
            )
        t0 = time.monotonic()
        loaded = load_replacement(model_path, load_format, core.model.cfg, core.weight_shapes)
        try:
            model = self.rebuild_model(loaded)
        except Exception as e:  # out of memory, a tensor the packing refuses: the old model stays
            log.exception("building the model from %s failed", model_path)
            raise ModelLoadError(
                f"building the model from {model_path} failed ({type(e).__name__}: {e}); "
                f"the old weights still serve"
            ) from None
        del loaded
        if core.loras is not None:
            core.loras.attach(model)  # the adapters serve on the new base weights
        core.model = core.runner.model = model
        if core.runner.graphs is not None:
            core.runner.graphs.set_model(model)  # the graphs hold the old weights' addresses: recapture
        flushed = core.kv_manager.tree.flush()
        dropped = core.sessions.session_kv.drop_all_kv()
        core.cfg = core.cfg.replace(model=model_path)
        core.info.model_path = model_path
        core.info.weight_bytes = model.weight_bytes()
        log.info(
            "weights updated from %s in %.1fs: %d cached pages and %d session tokens of KV dropped; "
            "%d request(s) paused", model_path, time.monotonic() - t0, flushed, dropped, len(s.reqs),
        )  # fmt: skip
        return {"num_paused_requests": len(s.reqs)}

    # -- the prefix cache, draining, shutdown -----------------------------------------------------------
    def flush_cache(self) -> bool:
        """Drop the prefix cache (every tier but the L3 files). Refused (False) while requests run:
        their pages are locked. File I/O still in flight is waited for first."""
        core = self.core
        core.settle_in_flight()
        if core.scheduler.has_requests:
            return False
        if core.connector is not None and not self._finish_connector_io():
            return False
        core.kv_manager.tree.flush()
        core.scheduler.images.flush_cache()  # the encoder cache's entries go with the next step
        return True

    def _finish_connector_io(self, timeout_s: float = 60.0) -> bool:
        """Step (no requests: only the connector's async work) until the connector has none in
        flight: under tensor parallelism a file op is done when every rank has reported it, and
        ranks report in steps. Then its own drain. False if that takes longer than ``timeout_s``."""
        core = self.core
        end = time.monotonic() + timeout_s
        while core.connector.has_pending:
            if time.monotonic() > end:
                return False
            core.step()
            if not core.last_step_ran:
                time.sleep(0.001)  # only file I/O left: let its thread have the GIL
        return core.connector.drain()

    def drain(self, timeout_s: float) -> bool:
        """Step until the scheduler is idle (requests ended, connector I/O done); False, with an
        error logged, if that takes longer than ``timeout_s``."""
        core = self.core
        end = time.monotonic() + timeout_s
        while not core.scheduler.idle:
            if time.monotonic() > end:
                s = core.scheduler
                log.error(
                    "engine: work left after %.0fs of draining (requests %s, connector pending %s): "
                    "closing anyway", timeout_s, sorted(s.reqs)[:10], s.connector.has_pending,
                )  # fmt: skip
                return False
            core.step()
            if not core.last_step_ran:
                time.sleep(0.001)  # only file or transfer I/O left: let its thread have the GIL
        return True

    def shutdown(self, drain_timeout_s: float = SHUTDOWN_DRAIN_S) -> int:
        """Everything still running ends through the release path, then sessions close; returns
        how many sessions were closed. The drain is bounded: an engine whose work cannot end (a
        transfer whose peer is gone, books a failed step left inconsistent) still closes its
        executor (TP workers) and connector after ``drain_timeout_s``, with an error naming what
        was left, instead of stepping forever."""
        core = self.core
        for rid in list(core.scheduler.reqs):
            core.abort(rid, "the engine is shutting down")
        self.drain(drain_timeout_s)
        sids = list(core.sessions.sessions)
        for sid in sids:
            self.close_session(sid)
        core.settle_in_flight()
        core.close_forward()
        core.grammars.shutdown()
        core.executor.shutdown()
        close = getattr(core.connector, "close", None)
        if close is not None:
            close()
        return len(sids)
