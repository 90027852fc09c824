"""The KV connector interface: KV that arrives from elsewhere (a prefill server, a host or file
tier) or must be sent elsewhere, modelled on vLLM's ``KVConnectorBase_V1``.

Scheduler side (rank 0, with the books):
  * ``check_request(req)``: refuse a request before it is queued (a room already in use).
  * ``request_refused(req, why)``: an earlier check refused it (PD: tell the other side at once).
  * ``request_queued(req)``: the request is in the waiting queue (every refusal is behind it): a
    connector may start fetching its KV (the hierarchical cache's L3 prefetch).
  * ``get_num_new_matched_tokens(req, num_computed)`` -> ``(n, load_async)``: how many tokens beyond
    the local prefix match can be loaded (all but the last prompt token; with ``load_async`` the
    whole prompt, when the connector also delivers the first output token: ``received_output``).
    ``n is None``: not known yet (a fetch still running); the scheduler admits others and asks again.
    With ``n > 0`` the scheduler allocates pages for them (they are the request's PRIVATE pages,
    owner ``req X [waiting for kv]`` while they arrive).
  * ``update_state_after_alloc(req, pages, n)``: where those tokens go.
  * ``cached_external_tokens(req, n)``: how many of them ``cached_tokens`` counts (a tier's hit yes,
    a transfer no: ``external_tokens_are_cached``).
  * ``build_connector_meta(sched_out)``: what the worker side needs for this step.
  * ``step_finished()``: the step's forward is over (or failed); take in finished async work.
  * ``has_pending``: async work in flight that the engine must keep stepping for (not idle).
  * ``request_finished(req)`` (a release hook: called on every ending, before the release) -> True
    to keep the request's pages until an async save ends (the request is then SENDING, owner
    ``req X [kv sending]``); its release happens when ``get_finished`` reports the rid done, through
    the same release path. A request aborted while WAITING_FOR_KV is finished the same way: the
    connector cancels its load, or returns True until the load has drained.
Worker side (every rank, with the KV tensors):
  * ``start_load_kv(meta, kv_buffer)``, ``wait_for_layer_load(layer)``,
    ``save_kv_layer(layer, kv_buffer)`` (the per-layer calls from the attention op), ``wait_for_save()``;
  * ``get_finished()`` -> ``(rids done sending, rids done receiving)``, reported to the scheduler in
    ``ModelRunnerOutput``.
``NoOpConnector`` is today's behaviour: nothing to load, nothing to send. ``MultiConnector``
(``multi.py``) makes several one (PD with the hierarchical cache).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Received(NamedTuple):
    """What the remote side computed for a request besides its KV (PD: prefill's first token)."""

    tokens: list[int]
    logprobs: list
    top_logprobs: list
    # Prompt tokens the remote side served from its own cache (PD: prefill's prefix match). KV that
    # arrives by transfer is not a cache hit; what the remote side did not compute is.
    cached_tokens: int = 0


class KVConnector:
    """Base class; every method has the no-op behaviour, so a connector overrides what it needs."""

    # Whether tokens loaded through this connector count as cached (``meta_info.cached_tokens``,
    # OpenAI's ``prompt_tokens_details.cached_tokens``): a host or file tier's hit is a cache hit;
    # KV computed by a remote prefill and transferred is not.
    external_tokens_are_cached: bool = True

    # -- scheduler side ---------------------------------------------------------------------------------
    def check_request(self, req) -> None:
        """Refuse ``req`` before it is queued (raise a KVLedgerError); the last check of a submit."""
        return None

    def request_refused(self, req, why: str) -> None:
        """``req`` was refused before it was queued (by a check before ``check_request``, whose own
        refusal is not reported); a connector may tell a peer waiting for it (PD: the other side)."""
        return None

    def request_queued(self, req) -> None:
        return None

    def may_admit(self, req) -> bool:
        """False: ``req`` must keep waiting before anything is held for it (asked every pass, before
        its slot and prefix match; PD prefill: until decode claims its room)."""
        return True

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, req, pages: list[int], num_external_tokens: int) -> None:
        return None

    def cached_external_tokens(self, req, num_external_tokens: int) -> int:
        """How many of the ``num_external_tokens`` just matched for ``req`` count as cached (a
        composite answers for the connector that matched them)."""
        return num_external_tokens if self.external_tokens_are_cached else 0

    def build_connector_meta(self, sched_out) -> Any:
        return None

    def request_finished(self, req) -> bool:
        return False

    def step_finished(self) -> None:
        return None

    @property
    def has_pending(self) -> bool:
        return False

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait for the async work in flight (before a flush); False if it did not end in time."""
        return True

    def received_output(self, req) -> Received | None:
        """Tokens the remote side already sampled for ``req`` (PD: prefill's first token), taken once
        its load is reported done, with how much of the prompt it served from its own cache."""
        return None

    # -- worker side ------------------------------------------------------------------------------------
    def start_load_kv(self, meta: Any, kv_buffer) -> None:
        return None

    def wait_for_layer_load(self, layer: int) -> None:
        return None

    def save_kv_layer(self, layer: int, kv_buffer) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self) -> tuple[set[str], set[str]]:
        return set(), set()


class NoOpConnector(KVConnector):
    """No external KV: every request computes its own (minus the prefix cache)."""
