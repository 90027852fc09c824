"""The offline ``Engine``'s admin verbs, in SGLang's shapes: pause and continue, weight updates, LoRA
adapters, the cache, sessions, and the views of memory. Each takes the engine's lock (one step or one
verb at a time) and calls the core's ``EngineControl`` or ``EngineView``; ``Engine`` (``offline.py``)
mixes them in beside its requests."""

from __future__ import annotations

import abc
import threading

from ..engine.core import EngineCore
from ..errors import KVLedgerError, ValidationError


class EngineAdmin(abc.ABC):
    """Admin verbs over ``core`` under ``_lock`` (both the ``Engine``'s)."""

    core: EngineCore
    _lock: threading.RLock

    @abc.abstractmethod
    def run_until_idle(self) -> None:
        """Step until nothing is left to do (the ``Engine``'s; a weight update waits for it)."""

    # -- pause and weight updates (SGLang's shapes) -------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating: ``abort`` ends every request (at the next step), ``retract`` requeues the
        running ones (recomputed, with the same output, after ``continue_generation``), ``in_place``
        keeps them where they are. Requests added meanwhile wait."""
        with self._lock:
            self.core.control.pause_generation(mode)

    def continue_generation(self) -> None:
        with self._lock:
            self.core.control.continue_generation()

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str, int]:
        """New weights from ``model_path`` (same architecture and shapes) without a restart; the prefix
        cache is flushed and sessions' KV dropped. As SGLang, when generation is not paused the
        requests in flight finish first. Returns ``(success, message, num_paused_requests)``."""
        with self._lock:
            if self.core.scheduler.paused is None:
                self.run_until_idle()
            try:
                n = self.core.control.update_weights_from_disk(model_path, load_format)["num_paused_requests"]
            except KVLedgerError as e:
                return False, e.message, 0
        return True, f"Succeeded to update model weights from {model_path}.", n

    # -- LoRA adapters (SGLang's /load_lora_adapter, /unload_lora_adapter) ----------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Serve the peft adapter at ``lora_path`` as ``lora_name`` (``sampling["lora_path"]`` selects it)."""
        with self._lock:
            return self.core.control.load_lora_adapter(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving ``lora_name``; refused (409) while requests of it are queued or running."""
        with self._lock:
            self.core.control.unload_lora_adapter(lora_name)

    def flush_cache(self) -> bool:
        with self._lock:
            return self.core.control.flush_cache()

    def memory(self) -> dict:
        with self._lock:
            return self.core.view.memory()

    def audit(self):
        with self._lock:
            return self.core.view.audit()

    def page_map(self) -> dict:
        """Every page's owner as runs, with the figures of the same instant (``/memory/pages``)."""
        with self._lock:
            return self.core.view.page_map()

    def open_session(
        self, session_id: str | None = None, streaming: bool = True, timeout: float | None = None
    ) -> str:
        """Open a streaming session (its turns keep their KV for the next turn); returns its id."""
        if streaming is not True:
            raise ValidationError("only streaming sessions are supported", param="streaming")
        with self._lock:
            return self.core.control.open_session(session_id, timeout)

    def close_session(self, session_id: str) -> None:
        """Close a session; if a turn is running its memory is released when that turn finishes."""
        with self._lock:
            self.core.control.close_session(session_id)

    def restore_sessions(self, records: list[dict]) -> int:
        """Re-open sessions from ``{id, timeout, tokens}`` records (no KV: their next turns recompute)."""
        with self._lock:
            return self.core.control.restore_sessions(records)

    def sessions(self) -> list[dict]:
        with self._lock:
            return self.core.sessions.describe()
