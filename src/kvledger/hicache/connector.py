"""The hierarchical cache on the KV connector seam: what a request loads back from L2 and L3.

Scheduler side:
  * ``request_queued``: a prompt whose pages are in L3 files but in no tier starts a prefetch
    (files -> L2) while it waits in the queue.
  * ``get_num_new_matched_tokens``: past the L1 match, the nodes that hold an L2 copy (whole nodes;
    none under ``load_back_threshold`` tokens). A request whose prefetch is still reading (and within
    its deadline) answers ``None``: the scheduler admits others and asks again next step.
  * ``update_state_after_alloc``: the fresh L1 pages (the request's PRIVATE pages) the L2 pages go
    to; those L2 pages are pinned until the step's forward is over (``step_finished``).
  * ``request_finished``: a request that ends cancels its prefetch (its pages are freed when the
    read stops; they are the prefetch's, not the request's) and forgets its pending match.
Worker side: ``wait_for_layer_load(layer)`` copies each load's layer just before that layer's
attention, so the copy of layer ``i + 1`` is not waited on by layer ``i`` (on a GPU, a side stream).

The loaded pages are the request's own: when it ends they go into the tree like computed KV, and an
L2-only node they match takes them as its L1 pages (``RadixCache.insert``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..connector import KVConnector
from ..memory.cache_key import cache_key
from .tiers import Tiers


@dataclass(slots=True)
class Load:
    rid: str
    host_pages: list[int]
    l1_pages: list[int]


class HiCacheConnector(KVConnector):
    def __init__(self, tiers: Tiers):
        self.tiers = tiers
        self._matched: dict[str, list[int]] = {}  # rid -> L2 pages of its match, until allocated
        self._queued: list[Load] = []  # loads admitted for the step being scheduled
        self._in_step: list[Load] = []  # ... and for the step that is running (pinned)
        self._worker_loads: list[Load] = []

    # -- scheduler side -------------------------------------------------------------------------------
    def request_queued(self, req) -> None:
        self.tiers.start_prefetch(req)

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._matched.pop(req.rid, None)
        if req.session is not None:
            return 0, False  # a session turn reads its session's own KV
        if self.tiers.prefetch_pending(req):
            return None, False
        t = self.tiers
        tokens = cache_key(req.fill_ids, req.params.cache_salt, t.page_size)[: req.reuse_limit]
        host, _ = t.tree.match_host(req.prefix_node, tokens, num_computed_tokens)
        n = len(host) * t.page_size
        if n < max(t.load_back_threshold, 1):
            t.stats.loads_skipped_small += bool(n)
            return 0, False
        self._matched[req.rid] = host
        return n, False

    def update_state_after_alloc(self, req, pages: list[int], num_external_tokens: int) -> None:
        host = self._matched.pop(req.rid)
        assert len(host) * self.tiers.page_size == num_external_tokens
        for p in host:
            self.tiers.host.pins[p] += 1
        self._queued.append(Load(req.rid, host, list(pages[: len(host)])))
        self.tiers.stats.l2_hit_tokens += num_external_tokens

    def build_connector_meta(self, sched_out) -> list[Load]:
        self._in_step, self._queued = self._queued, []
        return self._in_step

    def step_finished(self) -> None:
        """The step's forward is over (or failed): its loads' L2 pages are free to move again, and
        the I/O thread's finished ops are taken in."""
        for load in self._in_step:
            for p in load.host_pages:
                self.tiers.host.pins[p] -= 1
        self._in_step = []
        self.tiers.poll()

    def request_finished(self, req) -> bool:
        self._matched.pop(req.rid, None)
        self.tiers.cancel_prefetch(req.rid)
        return False

    @property
    def has_pending(self) -> bool:
        return self.tiers.pending

    def live_loads(self) -> list[Load]:
        """Loads whose L2 pages are pinned now (the books check the pins against them)."""
        return self._queued + self._in_step

    def drain(self, timeout_s: float = 60.0) -> bool:
        return self.tiers.drain(timeout_s)

    def close(self) -> None:
        self.tiers.close()

    # -- worker side ------------------------------------------------------------------------------------
    def start_load_kv(self, meta, kv_buffer) -> None:
        self._worker_loads = list(meta or ())

    def wait_for_layer_load(self, layer: int) -> None:
        kv = self.tiers.kv
        for load in self._worker_loads:
            self.tiers.host.load_layer(kv, layer, load.host_pages, load.l1_pages)

    def wait_for_save(self) -> None:
        self._worker_loads = []
