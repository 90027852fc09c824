"""Several KV connectors as one: the scheduler and the executor hold ONE connector, and PD with the
hierarchical cache needs two on each side (the tiers' ``HiCacheConnector`` and the transfer's
``PrefillConnector`` or ``DecodeConnector``). Modelled on vLLM's MultiConnector, on our seam:

* **External KV in order.** ``get_num_new_matched_tokens`` asks the connectors in order, each from
  where the ones before it stopped (``num_computed`` + what they matched); the request's external
  tokens are the sum. A connector that loads asynchronously (a transfer, which takes the rest of the
  prompt and brings the remote side's first token) ends the chain; ``None`` (a tier still reading
  files) defers the request. ``update_state_after_alloc`` gives each its own pages (every part but
  the last is whole pages: a tier's match is whole nodes), and ``cached_tokens`` counts each part
  as its connector says (a tier's hit is cached, transferred KV is not). PD with tiers puts the tiers
  first on both sides: prefill loads a prefix from L2/L3 before it computes the rest (its transfer
  comes after the request finished); decode loads what its tiers hold past its L1 prefix in the
  admission step (a step without a forward copies it all the same: ``ModelRunner.execute``) while
  the transfer brings the rest.
* **Every other call fans out**, in order: ``check_request`` (a connector that refuses stops the
  rest: the transfer's, which takes the room, goes last), ``request_queued``, ``may_admit`` (all must
  agree), ``build_connector_meta`` (a tuple, one meta each), the worker side with its own meta each,
  ``step_finished``, ``drain``, ``close``.
* **Held pages**: ``request_finished`` is True when any connector keeps the pages; the rid is
  reported finished (``get_finished``) once every connector that kept them reported it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import KVConnector, Received


class MultiConnector(KVConnector):
    def __init__(self, connectors: Sequence[KVConnector], page_size: int):
        if len(connectors) < 2:
            raise ValueError("a MultiConnector composes two connectors or more")
        self.page_size = page_size
        self.connectors = list(connectors)
        self._parts: dict[str, list[tuple[KVConnector, int]]] = {}  # rid -> who matched how many
        self._held: dict[str, int] = {}  # rid -> connectors still holding its pages (sending/draining)
        self._reported: dict[str, set[int]] = {}  # rid -> which of them reported it (index), until all

    # -- scheduler side -----------------------------------------------------------------------------
    def check_request(self, req) -> None:
        for c in self.connectors:
            c.check_request(req)

    def request_refused(self, req, why: str) -> None:
        for c in self.connectors:  # every one may have a peer waiting (PD: the other side's half)
            c.request_refused(req, why)

    def request_queued(self, req) -> None:
        for c in self.connectors:
            c.request_queued(req)

    def may_admit(self, req) -> bool:
        return all(c.may_admit(req) for c in self.connectors)

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._parts.pop(req.rid, None)
        parts: list[tuple[KVConnector, int]] = []
        total = 0
        for c in self.connectors:
            n, load_async = c.get_num_new_matched_tokens(req, num_computed_tokens + total)
            if n is None:
                return None, False  # a match made before it is dropped when the step ends
            if n > 0:
                parts.append((c, n))
                total += n
                if load_async:  # the rest of the prompt arrives with the remote side's first token
                    self._parts[req.rid] = parts
                    return total, True
        if parts:
            self._parts[req.rid] = parts
        return total, False

    def update_state_after_alloc(self, req, pages: list[int], num_external_tokens: int) -> None:
        parts = self._parts[req.rid]
        if sum(n for _, n in parts) != num_external_tokens:
            raise RuntimeError(f"req {req.rid}: {num_external_tokens} tokens to load, the parts matched {parts}")
        at = 0
        for c, n in parts:
            if at % self.page_size:
                raise RuntimeError("every part but the last is whole pages (a tier's match is)")
            c.update_state_after_alloc(req, pages[at // self.page_size :], n)
            at += n

    def cached_external_tokens(self, req, num_external_tokens: int) -> int:
        return sum(c.cached_external_tokens(req, n) for c, n in self._parts.get(req.rid, []))

    def build_connector_meta(self, sched_out) -> tuple:
        return tuple(c.build_connector_meta(sched_out) for c in self.connectors)

    def request_finished(self, req) -> bool:
        self._parts.pop(req.rid, None)
        held = sum(bool(c.request_finished(req)) for c in self.connectors)
        if held:
            self._held[req.rid] = held
        return held > 0

    def step_finished(self) -> None:
        for c in self.connectors:
            c.step_finished()

    @property
    def has_pending(self) -> bool:
        return any(c.has_pending for c in self.connectors)

    def drain(self, timeout_s: float = 60.0) -> bool:
        return all([c.drain(timeout_s) for c in self.connectors])  # every one, even after a False

    def received_output(self, req) -> Received | None:
        for c in self.connectors:
            got = c.received_output(req)
            if got is not None:
                return got
        return None

    # -- worker side --------------------------------------------------------------------------------
    def start_load_kv(self, meta: Any, kv_buffer) -> None:
        metas = meta if meta is not None else (None,) * len(self.connectors)
        for c, m in zip(self.connectors, metas, strict=True):
            c.start_load_kv(m, kv_buffer)

    def wait_for_layer_load(self, layer: int) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int, kv_buffer) -> None:
        for c in self.connectors:
            c.save_kv_layer(layer, kv_buffer)

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def get_finished(self) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        recving: set[str] = set()
        for i, c in enumerate(self.connectors):
            s, r = c.get_finished()
            for rid in s | r:
                if rid not in self._held:  # a load's end, or not a held request's: passed on as it came
                    if rid in s:
                        sending.add(rid)
                    if rid in r:
                        recving.add(rid)
                    continue
                seen = self._reported.setdefault(rid, set())
                seen.add(i)
                if len(seen) >= self._held[rid]:  # every connector that kept the pages is done
                    del self._held[rid], self._reported[rid]
                    sending.add(rid)
        return sending, recving

    def close(self) -> None:
        for c in self.connectors:
            c.close()
