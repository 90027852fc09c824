"""The hierarchical cache on the KV connector seam: what a request loads back from L2 and L3.

Scheduler side:
  * ``request_queued``: a prompt whose pages are in L3 files but in no tier starts a prefetch
    (files -> L2) while it waits in the queue.
  * ``get_num_new_matched_tokens``: past the L1 match, the nodes that hold an L2 copy (whole nodes;
    none under ``load_back_threshold`` tokens), pinned at once: the allocation that follows may evict
    L1 nodes, whose write_back copies need L2 room, and must not take the match's pages for it. A
    request whose prefetch is still reading (and within its deadline) answers ``None``: the scheduler
    admits others and asks again next step.
  * ``update_state_after_alloc``: the fresh L1 pages (the request's PRIVATE pages) the L2 pages go
    to; those L2 pages stay pinned until the step's forward is over (``step_finished``, which also
    unpins a match whose admission did not complete).
  * ``request_finished``: a request that ends cancels its prefetch (its pages are freed when the
    read stops; they are the prefetch's, not the request's) and forgets its pending match.
Worker side (``HiCacheWorker``, every rank; rank 0's is this connector itself):
``start_load_kv(meta)`` applies the ops rank 0's policy decided since the last step (ranks other than
0: rank 0 applied them as it decided), ``wait_for_layer_load(layer)`` copies each load's layer just
before that layer's attention, so the copy of layer ``i + 1`` is not waited on by layer ``i`` (on a
GPU, a side stream), and ``get_finished`` reports this rank's finished file ops to every rank after a
step that had some in flight (tensor parallelism: one gather to rank 0, which takes them in).

The loaded pages are the request's own: when it ends they go into the tree like computed KV, and an
L2-only node they match takes them as its L1 pages (``RadixCache.insert``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..connector import KVConnector
from ..memory.cache_key import cache_key
from .mover import TierMover
from .ops import HiCacheMeta, Load, TierOp, TierReport
from .tiers import Tiers

# Every rank's report, in rank order, on rank 0 (``parallel.frames.gather_tier_reports``; None on the others).
Gather = Callable[[TierReport], list[TierReport] | None]


class HiCacheWorker(KVConnector):
    """The hierarchical cache's worker side on one rank: the data movement for its heads."""

    def __init__(self, mover: TierMover, rank: int = 0, gather: Gather | None = None):
        self.mover = mover
        self.rank = rank
        self.gather = gather
        self._worker_loads: list[Load] = []
        self._report_now = False

    def start_load_kv(self, meta: HiCacheMeta | None, kv_buffer) -> None:
        if meta is None:
            self._worker_loads, self._report_now = [], False
            return
        if self.rank != 0:
            for op in meta.ops:
                self.mover.apply(op)
        self._worker_loads = list(meta.loads)
        self._report_now = meta.gather

    def wait_for_layer_load(self, layer: int) -> None:
        for load in self._worker_loads:
            self.mover.load_layer(layer, load.host_pages, load.l1_pages)

    def wait_for_save(self) -> None:
        self._worker_loads = []

    def exchange_reports(self) -> list[TierReport] | None:
        """After a step with file ops in flight: every rank's finished ones (on rank 0; None on the
        others, and when there was nothing to report)."""
        if not self._report_now:
            return None
        self._report_now = False
        return self.gather(self.mover.take_done())

    def get_finished(self) -> tuple[set[str], set[str]]:
        self.exchange_reports()
        return set(), set()

    def close(self) -> None:
        self.mover.close()


class HiCacheConnector(HiCacheWorker):
    """Rank 0: the scheduler side over the tiers' policy, and rank 0's worker side."""

    def __init__(self, tiers: Tiers, gather: Gather | None = None):
        super().__init__(tiers.mover, 0, gather)
        self.tiers = tiers
        self._matched: dict[str, list[int]] = {}  # rid -> L2 pages of its match, until allocated
        self._queued: list[Load] = []  # loads admitted for the step being scheduled
        self._in_step: list[Load] = []  # ... and for the step that is running (pinned)
        self._unsent: list[TierOp] = []  # ops for the other ranks, in a step not yet run
        self._reports: list[TierReport] = []  # every rank's finished file ops, from the last step

    # -- scheduler side -------------------------------------------------------------------------------
    def request_queued(self, req) -> None:
        self.tiers.prefetcher.start(req)

    def _pin(self, pages: list[int], by: int) -> None:
        for p in pages:
            self.tiers.host.pins[p] += by

    def _drop_match(self, rid: str) -> None:
        """A match that will not be loaded (asked again, the request ended, its admission failed)."""
        self._pin(self._matched.pop(rid, []), -1)

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._drop_match(req.rid)
        if req.session is not None:
            return 0, False  # a session turn reads its session's own KV
        if self.tiers.prefetcher.pending(req):
            return None, False
        t = self.tiers
        tokens = cache_key(req.fill_ids, req.params.cache_salt, t.page_size, req.lora_key, req.mm and req.mm.images)[: req.reuse_limit]
        host, _ = t.tree.match_host(req.prefix_node, tokens, num_computed_tokens)
        n = len(host) * t.page_size
        if n < max(t.load_back_threshold, 1):
            t.stats.loads_skipped_small += bool(n)
            return 0, False
        self._matched[req.rid] = host
        self._pin(host, 1)
        return n, False

    def update_state_after_alloc(self, req, pages: list[int], num_external_tokens: int) -> None:
        host = self._matched.pop(req.rid)  # pinned since the match
        if len(host) * self.tiers.page_size != num_external_tokens:
            raise RuntimeError(
                f"req {req.rid}: {num_external_tokens} tokens to load from {len(host)} matched L2 pages"
            )
        self._queued.append(Load(req.rid, host, list(pages[: len(host)])))
        self.tiers.stats.l2_hit_tokens += num_external_tokens

    def build_connector_meta(self, sched_out) -> HiCacheMeta:
        self._in_step, self._queued = self._queued, []
        # Ops of a step that did not run (nothing to execute) go with this one, ahead of the new.
        self._unsent = self._unsent + self.tiers.take_outbox()
        gather = self.tiers.tp_size > 1 and self.tiers.file_ops_in_flight
        return HiCacheMeta(self._unsent, self._in_step, gather)

    def step_finished(self) -> None:
        """The step's forward is over (or failed): its loads' L2 pages are free to move again, and
        the finished file ops are taken in (every rank's, gathered in the step, under TP)."""
        for load in self._in_step:
            self._pin(load.host_pages, -1)
        self._in_step = []
        for rid in list(self._matched):  # matched, but the admission did not complete
            self._drop_match(rid)
        reports, self._reports = self._reports, []
        self.tiers.report(reports)
        self.tiers.poll()

    def request_finished(self, req) -> bool:
        self._drop_match(req.rid)
        self.tiers.prefetcher.cancel(req.rid)
        return False

    @property
    def has_pending(self) -> bool:
        """File ops in flight, or ops the other ranks have not been sent: the engine steps on."""
        return self.tiers.pending or bool(self._unsent)

    def live_loads(self) -> list[Load]:
        """Loads whose L2 pages are pinned now, matches about to be loaded included (the books check
        the pins against them)."""
        matched = [Load(rid, host, []) for rid, host in self._matched.items()]
        return matched + self._queued + self._in_step

    def drain(self, timeout_s: float = 60.0) -> bool:
        return self.tiers.drain(timeout_s)

    # -- rank 0's worker side ------------------------------------------------------------------------
    def start_load_kv(self, meta: HiCacheMeta | None, kv_buffer) -> None:
        self._unsent = []  # the executor runs the step: the other ranks have it (broadcast first)
        super().start_load_kv(meta, kv_buffer)

    def get_finished(self) -> tuple[set[str], set[str]]:
        # Taken in by ``step_finished``, with the scheduler (not inside the executor's step).
        self._reports += self.exchange_reports() or []
        return set(), set()

    def close(self) -> None:
        self.tiers.close()
