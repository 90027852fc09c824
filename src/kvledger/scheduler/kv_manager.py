"""Memory operations on behalf of requests. The only code that changes a request's slot and pages.

``release`` is the one way a request's memory goes back: every finish (stop, length, abort, error)
and every retraction calls it, and so does an admission that cannot complete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from ..errors import MemoryLedgerError
from ..memory import Holding, Ledger, PagePool, RadixCache, ReqSlotPool
from .request import Req

log = logging.getLogger(__name__)


class KVManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_slots: int,
        max_context: int,
        enable_prefix_cache: bool,
        strict: bool,
        holdings: Callable[[], Iterable[Holding]],
    ):
        self.page_size = page_size
        self.pages = PagePool(num_pages, page_size)
        # A row must hold whole pages for the longest sequence.
        row = -(-max_context // page_size) * page_size
        self.slots = ReqSlotPool(num_slots, row)
        self.tree = RadixCache(page_size, self._free_evicted, enabled=enable_prefix_cache)
        self.ledger = Ledger(self.pages, self.slots, self.tree, holdings, strict)
        self.double_frees = 0
        self.sessions = None  # a SessionManager sets itself here
        self.session_evictions = 0

    def _free_evicted(self, pages: list[int]) -> None:
        self._free(pages, "radix eviction")

    def _free(self, pages: list[int], by: str) -> None:
        doubles = self.pages.free(pages, by)
        if doubles:
            # Never silently: the audit cannot see a double free after the fact, so report it now.
            self.double_frees += len(doubles)
            self.ledger.violations += len(doubles)
            msg = f"double free of pages {doubles[:20]} by {by}"
            if self.ledger.strict:
                raise MemoryLedgerError(msg)
            log.error(msg)

    # -- figures used by the scheduler ------------------------------------------------------------
    def available_pages(self) -> int:
        """Pages an allocation could get now: the free ones plus those eviction could free (unlocked
        cache, idle sessions' KV)."""
        n = self.pages.num_free + self.tree.evictable_pages
        if self.sessions is not None:
            n += sum(len(s.pages) for s in self.sessions.sessions.values() if s.busy_rid is None)
        return n

    def pages_needed(self, req: Req, n: int) -> int:
        return max(0, -(-(req.kv_len + n) // self.page_size) - len(req.pages))

    @staticmethod
    def holding(req: Req) -> Holding:
        return Holding(
            owner=f"req {req.rid}",
            kind="request",
            own_pages=req.pages[req.num_tree_pages :],
            borrowed_pages=req.pages[: req.num_tree_pages],
            slot=req.slot,
            borrowed_from=None if req.session is None else req.session.owner,
        )

    # -- allocation ----------------------------------------------------------------------------------
    def _alloc_pages(self, n: int, owner: str) -> list[int] | None:
        if self.pages.num_free < n:
            self.tree.evict(n - self.pages.num_free)
        if self.pages.num_free < n and self.sessions is not None:
            self._evict_session_kv(n - self.pages.num_free)
        return self.pages.alloc(n, owner)

    def _evict_session_kv(self, n: int) -> None:
        """Drop idle sessions' KV, least recently used first, so that sessions never starve normal
        requests. The sessions stay open; their next turn recomputes from their tokens."""
        idle = sorted(
            (s for s in self.sessions.sessions.values() if s.busy_rid is None and s.pages),
            key=lambda s: s.last_used,
        )
        for s in idle:
            if n <= 0:
                return
            n -= len(s.pages)
            self.free_session_pages(s)
            self.session_evictions += 1

    def free_session_pages(self, s) -> None:
        assert s.busy_rid is None, "a running turn borrows these pages"
        self._free(s.pages, s.owner)
        s.pages = []
        s.kv_len = 0

    def admit(self, req: Req) -> bool:
        """Give ``req`` a request slot and its cached prefix (locked). False: no slot free."""
        assert req.slot is None and not req.pages
        slot = self.slots.alloc(f"req {req.rid}")
        if slot is None:
            return False
        fill = req.fill_ids
        if req.session is not None:
            # A turn borrows its session's full pages (never the partial last one, which it would
            # write into); at least one token is always computed.
            s = req.session
            n = min(s.kv_len, req.session_offset, len(fill) - 1) // self.page_size
            pages, node = s.pages[:n], None
        else:
            # Match all but the last token: at least one token is always computed, so there are logits.
            pages, node = self.tree.match_prefix(fill[: len(fill) - 1])
            self.tree.inc_lock(node)
        req.slot = slot
        req.pages = list(pages)
        req.num_tree_pages = len(pages)
        req.prefix_node = node
        req.kv_len = len(pages) * self.page_size
        self.slots.write_pages(slot, 0, pages, self.page_size)
        return True

    def reserve(self, req: Req, n: int) -> bool:
        """Make sure pages exist for the next ``n`` tokens of ``req`` (evicting cache if needed)."""
        need = self.pages_needed(req, n)
        if need == 0:
            return True
        new = self._alloc_pages(need, f"req {req.rid}")
        if new is None:
            return False
        self.slots.write_pages(req.slot, len(req.pages), new, self.page_size)
        req.pages.extend(new)
        return True

    # -- the one release path for request memory -------------------------------------------------------
    def release(self, req: Req, commit: bool, final: bool = True) -> None:
        """Give back everything ``req`` holds.

        ``commit``: put its computed, page-aligned KV into the radix tree (pages already cached by
        someone else are freed as duplicates), or for a session turn make it the session's KV; the
        partial last page and any over-allocation are freed. Without ``commit`` (an aborted turn, KV
        that must not be reused) every private page is freed and nothing else changes.
        ``final``: the request ends here (False for a retraction or a failed admission).
        """
        if req.session is not None:
            self._release_turn(req, commit, final)
            return
        if req.slot is None:
            assert not req.pages
            return
        ps = self.page_size
        owner = f"req {req.rid}"
        first_private = req.num_tree_pages
        if commit and self.tree.enabled:
            aligned = req.kv_len // ps
            fill = req.fill_ids
            present = self.tree.insert(fill[: aligned * ps], req.pages[:aligned]) // ps
            # [num_tree_pages, present): someone else cached the same tokens meanwhile -> duplicates.
            self._free(req.pages[first_private:present], owner)
            self.pages.set_owner(req.pages[max(present, first_private) : aligned], "radix")
            self._free(req.pages[aligned:], owner)
        else:
            self._free(req.pages[first_private:], owner)
        self.tree.dec_lock(req.prefix_node)  # type: ignore[arg-type]
        self._reset(req, owner)

    def _reset(self, req: Req, owner: str) -> None:
        self.slots.free(req.slot, owner)
        req.slot = None
        req.pages = []
        req.num_tree_pages = 0
        req.prefix_node = None
        req.kv_len = 0

    def _release_turn(self, req: Req, commit: bool, final: bool) -> None:
        s = req.session
        owner = f"req {req.rid}"
        if req.slot is not None:
            borrowed = req.num_tree_pages
            if commit and final and not s.closing:
                keep = -(-req.kv_len // self.page_size)
                # The session's pages past what the turn borrowed (its old partial page, or a tail
                # orphaned by a shorter offset) are superseded: free them before taking the new ones.
                self._free(s.pages[borrowed:], s.owner)
                self._free(req.pages[keep:], owner)
                self.pages.set_owner(req.pages[borrowed:keep], s.owner)
                s.pages = req.pages[:keep]
                s.kv_len = req.kv_len
                s.tokens = req.fill_ids
                s.turns += 1
            else:
                self._free(req.pages[borrowed:], owner)
            self._reset(req, owner)
        if final:
            s.busy_rid = None
            s.last_used = time.monotonic()
            req.session = None
            if s.closing:
                self.sessions.release(s)  # close_on_finish
