"""The tiers' policy on the scheduler's side: L2 allocation (evicting L2 nodes for room), backups
(L1 -> L2 under the write policy, then L2 -> L3), L3 prefetches for queued requests, load-backs for
admitted ones, and idle sessions' demotion. Every page movement between tiers is here; the books
(``books.py``) check the result.

Copies between L1 and L2 are memcpys made here, on the engine's thread (the load-back's per-layer
copies run in the forward, ``connector.py``). File I/O runs on the I/O thread (``io.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from ..memory.cache_key import cache_key
from ..memory.pools import KVBuffer
from .host_pool import HostPool
from .io import PrefetchOp, StorageIO, StoreOp
from .storage import FileStorage, PageHasher

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
    stores: int = 0
    session_demotions: int = 0
    session_promotions: int = 0
    session_drops: int = 0  # demoted sessions whose KV could not come back (recomputed)


class Tiers:
    def __init__(
        self,
        host: HostPool,
        write_policy: str,
        hasher: PageHasher,
        storage: FileStorage | None = None,
        load_back_threshold: int = 16,
        prefetch_threshold: int = 64,
        prefetch_timeout_s: float = 2.0,
    ):
        self.host = host
        self.page_size = host.page_size
        self.write_policy = write_policy
        self.write_back = write_policy == "write_back"
        # Hits before a node is copied to L2 (write_back copies on eviction instead).
        self.backup_threshold = {"write_through": 1, "write_through_selective": 2}.get(write_policy, 1 << 30)
        self.hasher = hasher
        self.storage = storage
        self.io = StorageIO(storage, host) if storage is not None else None
        self.load_back_threshold = load_back_threshold
        self.prefetch_threshold = prefetch_threshold
        self.prefetch_timeout_s = prefetch_timeout_s
        self.stats = TierStats()
        self.tree = None  # HiRadixCache, set by KVManager
        self.kv_manager = None
        self.kv: KVBuffer | None = None  # L1's tensors, bound once the runner exists
        self.prefetches: dict[str, PrefetchOp] = {}  # rid -> its prefetch in flight
        self.stores: dict[int, StoreOp] = {}  # op id -> store in flight
        self._orphans: dict[int, PrefetchOp] = {}  # prefetches whose request ended or moved on

    def bind(self, kv: KVBuffer) -> None:
        self.kv = kv

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
        self.host.save(self.kv, node.pages, host)
        self.tree.attach_host(node, host)
        self.stats.backed_up_pages += len(host)
        if self.io is not None:
            keys = self.hasher.chain(self.tree.path_tokens(node))[-len(host) :]
            op = StoreOp(keys, list(host))
            for p in host:
                self.host.storing[p] = 1
            self.stores[op.id] = op
            self.stats.stores += 1
            self.io.submit(op)
        return True

    # -- L3 prefetch (a request was queued) ----------------------------------------------------------
    def start_prefetch(self, req) -> None:
        """Read the files of the prompt's pages that no tier holds, while the request waits in the
        queue: they go to L2 pages owned by the prefetch, and into the tree when read."""
        if self.io is None or req.session is not None:
            return
        ps = self.page_size
        tokens = cache_key(req.fill_ids, req.params.cache_salt, ps)[: req.reuse_limit]
        npages = len(tokens) // ps
        have = self.tree.covered(tokens) // ps
        if (npages - have) * ps < self.prefetch_threshold:
            return
        keys = self.hasher.chain(tokens, npages)
        k = self.storage.batch_exists(keys[have:])
        if k * ps < self.prefetch_threshold:
            return
        host = self.host_alloc(k, f"prefetch for req {req.rid}")
        if host is None:
            self.stats.prefetch_no_room += 1
            return
        op = PrefetchOp(
            req.rid,
            tokens[: (have + k) * ps],
            have,
            keys[have : have + k],
            host,
            time.monotonic() + self.prefetch_timeout_s,
        )
        self.prefetches[req.rid] = op
        self.stats.prefetches += 1
        self.io.submit(op)

    def prefetch_pending(self, req) -> bool:
        """Whether ``req`` should wait for its prefetch (in flight and within its deadline)."""
        op = self.prefetches.get(req.rid)
        if op is None:
            return False
        if time.monotonic() < op.deadline:
            return True
        # Late: the request goes on without it; the read still lands in the tree for later requests.
        self._orphans[op.id] = self.prefetches.pop(req.rid)
        self.stats.prefetches_late += 1
        return False

    def cancel_prefetch(self, rid: str) -> None:
        op = self.prefetches.pop(rid, None)
        if op is not None:
            op.cancelled = True
            self._orphans[op.id] = op
            self.stats.prefetches_cancelled += 1

    def _prefetch_done(self, op: PrefetchOp) -> None:
        if self.prefetches.get(op.rid) is op:
            del self.prefetches[op.rid]
        self._orphans.pop(op.id, None)
        ps = self.page_size
        good = op.host_pages[: op.good]
        unused = op.host_pages[op.good :]
        if good:
            # Read pages are good KV whether or not their request is still here: into the tree.
            end = (op.start_page + op.good) * ps
            back = self.tree.insert_host(op.tokens[:end], good, op.start_page * ps)
            self.stats.l3_hit_tokens += (len(good) - len(back)) * ps
            unused = back + unused
        self.host_free(unused, op.owner)

    def prefetch_ops(self) -> list[PrefetchOp]:
        """Every prefetch in flight (the books: their L2 pages are theirs)."""
        return list(self.prefetches.values()) + list(self._orphans.values())

    # -- completions -----------------------------------------------------------------------------------
    def poll(self) -> None:
        """Take in the I/O thread's finished ops (each step, and while draining)."""
        if self.io is None:
            return
        for op in self.io.take_done():
            if isinstance(op, StoreOp):
                self.stores.pop(op.id, None)
                for p in op.host_pages:
                    self.host.storing[p] = 0
            else:
                self._prefetch_done(op)

    @property
    def pending(self) -> bool:
        return bool(self.prefetches or self._orphans or self.stores)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait for every file op in flight (flush_cache, shutdown). False if some are still running."""
        end = time.monotonic() + timeout_s
        while True:
            self.poll()
            if not self.pending:
                return True
            if time.monotonic() > end:
                return False
            time.sleep(0.002)

    # -- sessions ------------------------------------------------------------------------------------------
    def demote_session(self, s) -> bool:
        """An idle session's KV goes to L2 (its L1 pages are freed); False: no L2 room."""
        host = self.host_alloc(len(s.pages), s.owner)
        if host is None:
            return False
        self.host.save(self.kv, s.pages, host)
        self.kv_manager.free(s.pages, s.owner)
        s.pages, s.host = [], host
        self.stats.session_demotions += 1
        return True

    def promote_session(self, s) -> None:
        """A demoted session's next turn: its KV comes back to fresh L1 pages (or, with no L1 room,
        is dropped and recomputed from its tokens)."""
        pages = self.kv_manager._alloc_pages(len(s.host), s.owner)
        if pages is not None:
            self.host.load(self.kv, s.host, pages)
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
            "l2_prefetching": sum(len(op.host_pages) for op in self.prefetch_ops()) * ps,
            "l2_session": session_host_pages * ps,
            "storage_backend": "file" if self.storage is not None else None,
            **asdict(self.stats),
        }
        if self.storage is not None:
            out.update(self.storage.figures())
        return out

    def close(self) -> None:
        if self.io is not None:
            if not self.drain(timeout_s=30):
                log.warning("hicache: L3 writes still running at shutdown; some pages were not stored")
            self.io.close()
