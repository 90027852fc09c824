"""The tiers' policy on the scheduler's side (rank 0, with the books): L2 allocation (evicting L2
nodes for room), backups (L1 -> L2 under the write policy, then L2 -> L3), L3 prefetches for queued
requests (``prefetch.py``), load-backs for admitted ones, and idle sessions' demotion. Every page
movement between tiers is decided here or in ``prefetch.py``; the books (``books.py``) check the result.

The data moves on every rank (``mover.py``): each decision is an op (``ops.py``) that rank 0's mover
applies at once (the L1 <-> L2 copies are memcpys on the engine's thread; file I/O goes to its I/O
thread) and, under tensor parallelism, the other ranks apply at the start of their next step. A file
op is done when every rank has reported it (``report``): its L2 pages stay pinned (a store) or the
prefetch's (a read) until then, and a read counts the pages every rank read.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..memory.pools import KVBuffer
from .host_pool import HostPool
from .mover import TierMover
from .ops import Restore, Save, Store, TierOp, TierReport
from .prefetch import Prefetcher
from .tree import HiRadixCache

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    backed_up_pages: int = 0  # L1 -> L2 copies
    backup_no_room: int = 0  # backups skipped: L2 full of pinned or session pages
    l1_demoted_pages: int = 0  # L1 pages evicted whose node kept its L2 copy
    l2_evicted_pages: int = 0
    l2_hit_tokens: int = 0  # tokens loaded back from L2 instead of computed
    loads_skipped_small: int = 0  # L2 matches under the load-back threshold (recomputed)
    l3_hit_tokens: int = 0  # tokens prefetched from L3 into the tree
    prefetches: int = 0
    prefetches_cancelled: int = 0  # their request ended first (pages freed when the read stopped)
    prefetches_late: int = 0  # admitted past the deadline without waiting
    prefetch_no_room: int = 0
    prefetch_pages_short: int = 0  # pages some rank read and another did not (a miss on all ranks)
    stores: int = 0
    session_demotions: int = 0
    session_promotions: int = 0
    session_drops: int = 0  # demoted sessions whose KV could not come back (recomputed)


class Tiers:
    def __init__(
        self,
        host: HostPool,
        mover: TierMover,
        write_policy: str,
        tp_size: int = 1,
        load_back_threshold: int = 16,
        prefetch_threshold: int = 64,
        prefetch_timeout_s: float = 2.0,
    ):
        self.host = host
        self.mover = mover  # rank 0's data: its heads of the L2 pages, its files
        self.tp_size = tp_size
        self.page_size = host.page_size
        self.write_policy = write_policy
        self.write_back = write_policy == "write_back"
        # Hits before a node is copied to L2 (write_back copies on eviction instead).
        self.backup_threshold = {"write_through": 1, "write_through_selective": 2}.get(write_policy, 1 << 30)
        self.storage = mover.storage  # rank 0's files: what exists (``batch_exists``), figures
        self.load_back_threshold = load_back_threshold
        self.stats = TierStats()
        self.tree = None  # HiRadixCache, set by KVManager
        self.kv_manager = None
        self.prefetcher = Prefetcher(self, prefetch_threshold, prefetch_timeout_s)  # L3 reads for queued requests
        self.stores: dict[int, list[int]] = {}  # op id -> the L2 pages of a store in flight
        self._store_reports: dict[int, int] = {}  # op id -> ranks that have reported the store
        self.outbox: list[TierOp] = []  # ops for the other ranks, until the next step ships them
        self.op_ids = itertools.count(1)  # file ops' ids (stores and prefetches' reads)

    @property
    def hasher(self):
        return self.mover.hasher

    @property
    def io(self):
        return self.mover.io

    def bind(self, kv: KVBuffer) -> None:
        self.mover.bind(kv)

    def make_tree(self, page_size: int, free_pages: Callable[[list[int]], None]) -> HiRadixCache:
        """The radix tree over these tiers (``KVManager`` builds its tree here when it has tiers:
        the memory layer knows the tree's contract, not the tiers' subclass of it)."""
        return HiRadixCache(page_size, free_pages, self)

    def do(self, op: TierOp) -> None:
        """Apply ``op`` here now, and on every other rank at its next step."""
        self.mover.apply(op)
        if self.tp_size > 1:
            self.outbox.append(op)

    def take_outbox(self) -> list[TierOp]:
        out, self.outbox = self.outbox, []
        return out

    # -- L2 pages -------------------------------------------------------------------------------------
    def host_alloc(self, n: int, owner: str) -> list[int] | None:
        if self.host.num_free < n:
            self.tree.evict_host(n - self.host.num_free)
        return self.host.alloc(n, owner)

    def host_free(self, pages: list[int], by: str) -> None:
        doubles = self.host.free(pages, by)
        if doubles:
            self.kv_manager.report_double_free(doubles, by, tier="L2")

    # -- backups: L1 -> L2 -> L3 ------------------------------------------------------------------------
    def backup(self, node) -> bool:
        """Copy ``node``'s L1 pages to fresh L2 pages (then to L3 when storage is on)."""
        host = self.host_alloc(len(node.pages), node.owner)
        if host is None:
            self.stats.backup_no_room += 1
            return False
        self.do(Save(list(node.pages), host))
        self.tree.attach_host(node, host)
        self.stats.backed_up_pages += len(host)
        if self.storage is not None:
            op = Store(next(self.op_ids), self.tree.path_tokens(node), list(host))
            for p in host:
                self.host.storing[p] = 1
            self.stores[op.id] = op.host_pages
            self.stats.stores += 1
            self.do(op)
        return True

    # -- completions -----------------------------------------------------------------------------------
    def report(self, reports: list[TierReport]) -> None:
        """Take in finished file ops, one report per rank: an op is done when every rank has
        reported it."""
        for rank_report in reports:
            for op_id, good in rank_report:
                if op_id in self.stores:
                    n = self._store_reports[op_id] = self._store_reports.get(op_id, 0) + 1
                    if n == self.tp_size:
                        del self._store_reports[op_id]
                        for p in self.stores.pop(op_id):
                            self.host.storing[p] = 0
                elif op_id in self.prefetcher.reads:
                    op = self.prefetcher.reads[op_id]
                    op.reports.append(good)
                    if len(op.reports) == self.tp_size:
                        self.prefetcher.done(op)
                else:
                    log.error("hicache: a rank reported file op %d, which is not in flight", op_id)

    def poll(self) -> None:
        """Take in this rank's finished file ops (each step, and while draining); under tensor
        parallelism every rank's reports come with the step instead (``HiCacheConnector``)."""
        if self.tp_size == 1:
            self.report([self.mover.take_done()])

    @property
    def file_ops_in_flight(self) -> bool:
        return bool(self.prefetcher.reads or self.stores)

    @property
    def pending(self) -> bool:
        return self.file_ops_in_flight or bool(self.outbox)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait for every file op in flight (shutdown). False if some are still running. Under tensor
        parallelism the other ranks report only in steps, which the engine runs until idle first."""
        end = time.monotonic() + timeout_s
        while True:
            self.poll()
            if not self.pending or self.tp_size > 1:
                return not self.pending
            if time.monotonic() > end:
                return False
            time.sleep(0.002)

    # -- sessions ------------------------------------------------------------------------------------------
    def demote_session(self, s) -> bool:
        """An idle session's KV goes to L2 (its L1 pages are freed); False: no L2 room."""
        host = self.host_alloc(len(s.pages), s.owner)
        if host is None:
            return False
        self.do(Save(list(s.pages), host))
        self.kv_manager.free(s.pages, s.owner)
        s.pages, s.host = [], host
        self.stats.session_demotions += 1
        return True

    def promote_session(self, s) -> None:
        """A demoted session's next turn: its KV comes back to fresh L1 pages (or, with no L1 room,
        is dropped and recomputed from its tokens)."""
        pages = self.kv_manager._alloc_pages(len(s.host), s.owner)
        if pages is not None:
            self.do(Restore(list(s.host), pages))
            self.stats.session_promotions += 1
        else:
            self.stats.session_drops += 1
            s.kv_len = 0
        self.host_free(s.host, s.owner)
        s.host, s.pages = [], pages or []

    # -- figures ---------------------------------------------------------------------------------------------
    def figures(self, session_host_pages: int) -> dict:
        ps = self.page_size
        pinned = sum(1 for p in range(self.host.num_pages) if self.host.pins[p])
        storing = sum(self.host.storing)
        out = {
            "write_policy": self.write_policy,
            "l2_total": self.host.num_pages * ps,
            "l2_free": self.host.num_free * ps,
            "l2_cached": self.tree.host_pages * ps,
            "l2_loading": pinned * ps,
            "l2_storing": storing * ps,
            "l2_prefetching": sum(len(op.host_pages) for op in self.prefetcher.ops()) * ps,
            "l2_session": session_host_pages * ps,
            "storage_backend": "file" if self.storage is not None else None,
            **asdict(self.stats),
        }
        if self.storage is not None:
            out.update(self.storage.figures())
        return out

    def close(self) -> None:
        if self.storage is not None and not self.drain(timeout_s=30):
            log.warning("hicache: L3 writes still running at shutdown; some pages were not stored")
        self.mover.close()
