"""Pause, continue and weight updates in the front (SGLang's ``/pause_generation``,
``/continue_generation``, ``/update_weights_from_disk``, what RL trainers drive between rollouts).

``GenerationGate`` is where new generation requests wait (before they are submitted: they hold
nothing) while generation is paused or weights are being updated, as SGLang's tokenizer manager
holds them on its pause condition and its model-update lock. ``Control`` orders the operations:

- pause: close the gate, then tell the engine (``Scheduler.pause``: abort, retract or in place);
  with ``abort``, answer once the requests it aborted have ended.
- continue: tell the engine, then open the gate.
- update: with ``abort_all_requests``, abort every request first. Then, while paused, at once (the
  engine refuses if requests paused in place hold KV); otherwise close the gate, let the requests in
  flight finish, update, open the gate. The engine client then starts a restarted engine on the new
  weights.
"""

from __future__ import annotations

import asyncio
import logging

from ..config import EngineConfig
from ..errors import ServiceUnavailable
from .engine_client import EngineClient

log = logging.getLogger("kvledger.server")

ABORT_WAIT_S = 30.0  # how long a pause with mode abort waits for the aborted requests' last outputs
UPDATE_CALL_S = 600.0  # a weight update reads a checkpoint: far longer than a control call


class GenerationGate:
    """Open, or closed while generation is paused (``paused``: the mode) or weights are updating."""

    def __init__(self) -> None:
        self.paused: str | None = None
        self.updating = False
        self.shut = False  # the server is shutting down: waiters get a 503
        self._cond = asyncio.Condition()

    @property
    def closed(self) -> bool:
        return self.paused is not None or self.updating

    async def wait_open(self) -> None:
        """Return when new requests may go to the engine (at once when open)."""
        if not self.closed and not self.shut:
            return
        async with self._cond:
            await self._cond.wait_for(lambda: self.shut or not self.closed)
        if self.shut:
            raise ServiceUnavailable("the server is shutting down", code="shutting_down")

    async def set_paused(self, mode: str | None) -> None:
        await self._change(lambda: setattr(self, "paused", mode))

    async def set_updating(self, updating: bool) -> None:
        await self._change(lambda: setattr(self, "updating", updating))

    async def _change(self, change) -> None:
        async with self._cond:
            change()
            self._cond.notify_all()

    async def shut_down(self) -> None:
        async with self._cond:
            self.shut = True
            self._cond.notify_all()


class Control:
    """The admin operations on generation; one at a time."""

    def __init__(self, client: EngineClient, gate: GenerationGate):
        self.client = client
        self.gate = gate
        self._lock = asyncio.Lock()

    async def pause(self, mode: str) -> int:
        """Pause; returns how many requests the engine holds paused."""
        async with self._lock:
            client = self.client
            in_flight, before = set(client.streams), self.gate.paused
            await self.gate.set_paused(mode)
            try:
                held = await client.call("pause_generation", mode=mode)
            except BaseException:
                await self.gate.set_paused(before)  # the engine did not change: neither does the front
                raise
            if mode == "abort":
                await self._wait_ended(in_flight, ABORT_WAIT_S)
            log.info("generation paused (mode %s): %d request(s) held", mode, held)
            return held

    async def resume(self) -> None:
        async with self._lock:
            await self.client.call("continue_generation")
            await self.gate.set_paused(None)
            log.info("generation continued")

    async def update_weights(self, model_path: str, load_format: str | None, abort_all: bool) -> int:
        """Update the engine's weights; returns SGLang's ``num_paused_requests``."""
        async with self._lock:
            client = self.client
            paused = self.gate.paused is not None
            if not paused:
                await self.gate.set_updating(True)
            try:
                if abort_all:  # paused or not, as SGLang: a paused engine still ends aborted requests
                    rids = set(client.streams)
                    for rid in rids:
                        await client.abort(rid, "aborted for a weight update (abort_all_requests)")
                    await self._wait_ended(rids, ABORT_WAIT_S)
                if not paused:
                    await self._wait_ended(set(client.streams), None)  # SGLang waits for them
                result = await client.call(
                    "update_weights_from_disk", UPDATE_CALL_S, blocking=True, model_path=model_path,
                    load_format=load_format,
                )  # fmt: skip
            finally:
                if not paused:
                    await self.gate.set_updating(False)
            # A restarted engine loads what now serves, in the precision it was resolved to.
            flat = client.cfg.flat()
            flat.update(model=model_path, quantization=client.engine_config.get("quantization"))
            client.cfg = EngineConfig.from_flat(**flat)
            client.info["model_path"] = model_path
            client.engine_config["model"] = model_path
            return result["num_paused_requests"]

    async def _wait_ended(self, rids: set[str], timeout_s: float | None) -> None:
        """Until none of ``rids`` is in flight (their final outputs reached their streams)."""
        loop = asyncio.get_running_loop()
        end = None if timeout_s is None else loop.time() + timeout_s
        while rids & set(self.client.streams):
            if end is not None and loop.time() > end:
                log.warning("%d aborted request(s) had not ended after %.0f s", len(rids), timeout_s)
                return
            await asyncio.sleep(0.02)
