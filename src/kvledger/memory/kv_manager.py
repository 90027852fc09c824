"""Memory operations on behalf of requests: the only code that changes a request's slot and pages.

Who owns each region of a running request's pages (``req.pages``): the table in ``req_pages.py``.

``release`` is the one way a request's memory goes back: every finish (stop, length, abort, error),
every retraction and an admission that cannot complete call it. It never stops in the middle: each
step runs whatever the one before did (``Ledger.contain``), and the slot is always freed. Ownership
checks raise ``OwnershipError`` before anything changes (real checks: ``python -O`` keeps them).
Page-table changes are queued as ``PageWrite``s for the executor, which owns the request->token table.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable

from ..errors import MemoryLedgerError, OwnershipError
from .audit import Holding
from .cache_key import cache_key
from .ledger import Ledger
from .pools import PagePool, ReqSlotPool
from .radix import RadixCache
from .req_pages import PageWrite, forget_pages
from .session_kv import SessionKV
from .sparse_kv import SparseBooks, SparseKV
from .window import WindowKV

log = logging.getLogger(__name__)


class KVManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_slots: int,
        enable_prefix_cache: bool,
        strict: bool,
        holdings: Callable[[], Iterable[Holding]],
        tiers=None,
        window: int | None = None,
        tier_books=None,
        sparse: Callable[[KVManager], SparseKV] | None = None,
    ):
        """``window``: the model's release window (``window.release_window``; None: every page of a
        running request is kept). ``tiers``, ``tier_books``: the L2/L3 tiers under the tree and their
        books (``hicache/``; None: L1 only). ``sparse``: HiSparse's books over these pools, made from
        this manager (None: off)."""
        self.page_size = page_size
        self.pages = PagePool(num_pages, page_size)
        self.slots = ReqSlotPool(num_slots)
        self.tiers = tiers  # hicache/tiers.py: the L2 and L3 tiers under the tree (None: L1 only)
        if tiers is not None:  # the tiers bring the tree that backs up to them (memory knows no tier)
            self.tree: RadixCache = tiers.make_tree(page_size, self._free_evicted)
            tiers.tree, tiers.kv_manager = self.tree, self
        else:
            self.tree = RadixCache(page_size, self._free_evicted, enabled=enable_prefix_cache)
        # Pages a component of the engine keeps for its whole life (``reserve``), by owner.
        self.reserved: list[Holding] = []
        self.sparse = sparse(self) if sparse is not None else None  # memory/sparse_kv.py SparseKV
        self.ledger = Ledger(
            self.pages,
            self.slots,
            self.tree,
            lambda: itertools.chain(self.reserved, holdings()),
            strict,
            tier_books,
            SparseBooks(self.sparse) if self.sparse is not None else None,
        )
        self.tree.contain = self.ledger.contain  # a failing tree hook (a tier's backup) stops no release
        self.sessions = SessionKV(self)
        self.window = WindowKV(self, window) if window else None  # sliding windows' releases
        self.ledger.window = self.window
        self.double_frees = 0
        self._page_writes: list[PageWrite] = []

    def free(self, pages: list[int], by: str) -> None:
        doubles = self.pages.free(pages, by)
        if doubles:
            self.report_double_free(doubles, by)

    def report_double_free(self, doubles: list[int], by: str, tier: str = "L1", what: str = "pages") -> None:
        # Never silently: the audit cannot see a double free after the fact, so report it now.
        self.double_frees += len(doubles)
        self.ledger.violations += len(doubles)
        msg = f"double free of {tier} {what} {doubles[:20]} by {by}"
        if self.ledger.strict:
            raise MemoryLedgerError(msg)
        log.error(msg)

    def reserve(self, owner: str, n: int = 1) -> list[int]:
        """Take ``n`` pages out of the pool for the engine's life, in the books as a holding of kind
        ``reserved`` named ``owner`` (the CUDA-graph runner's padding page: ``engine/graph_runner.py``).
        Taken at start, before any request, so nothing is evicted for them; no request ever maps
        them. Raises if the pool cannot spare them."""
        pages = self.pages.alloc(n, owner)
        if pages is None:
            raise MemoryLedgerError(f"{owner}: the KV pool has fewer than {n} free pages to reserve")
        self.reserved.append(Holding(owner=owner, kind="reserved", own_pages=tuple(pages)))
        return pages

    @property
    def reserved_pages(self) -> int:
        return sum(len(h.own_pages) for h in self.reserved)

    def _free_evicted(self, pages: list[int]) -> None:
        self.free(pages, "radix eviction")

    def take_page_writes(self) -> list[PageWrite]:
        writes, self._page_writes = self._page_writes, []
        return writes

    def _map(self, req, start_page: int, pages: list[int]) -> None:
        if pages:
            self._page_writes.append(PageWrite(req.slot, start_page, list(pages)))

    # -- figures used by the scheduler ------------------------------------------------------------
    def available_pages(self) -> int:
        """Pages an allocation could get now: free ones plus those eviction could free (unlocked
        cache, idle sessions' KV)."""
        return self.pages.num_free + self.tree.evictable_pages + self.sessions.idle_pages()

    def pages_needed(self, req, n: int) -> int:
        """Pages to add so that ``req`` has room for ``n`` tokens past its computed KV."""
        if req.sparse is not None and req.sparse.active:
            return 0  # its KV goes to its reserved host pages (and its hot write page)
        return max(0, -(-(req.kv_len + n) // self.page_size) - len(req.pages))

    def slide_window(self, req, first_query: int) -> int:
        """Sliding-window models: give back ``req``'s pages that a query at ``first_query`` and later
        never read (``window.WindowKV.slide``); returns how many. A no-op without a window."""
        if self.window is None or req.slot is None or req.sparse is not None:
            return 0
        return self.window.slide(req, first_query)

    # -- allocation ----------------------------------------------------------------------------------
    def _alloc_pages(self, n: int, owner: str) -> list[int] | None:
        if self.pages.num_free < n:
            self.tree.evict(n - self.pages.num_free)
        if self.pages.num_free < n:
            self.sessions.evict_idle(n - self.pages.num_free)
        return self.pages.alloc(n, owner)

    def cache_key(self, req) -> list[int]:
        """``req``'s tokens as the prefix cache keys them (salted by its ``cache_salt`` and LoRA adapter)."""
        return cache_key(req.fill_ids, req.params.cache_salt, self.page_size, req.lora_key, _images(req))

    def admit(self, req) -> bool:
        """Give ``req`` a request slot and its cached prefix (locked). False: no slot free."""
        if req.slot is not None or req.pages:
            raise OwnershipError(
                f"req {req.rid} is admitted while it holds slot {req.slot} and {len(req.pages)} page entries"
            )
        slot = self.slots.alloc(f"req {req.rid}")
        if slot is None:
            return False
        if req.session is not None:
            pages, node = self.sessions.borrow(req), None
        else:
            # At least one token is always computed, so there are logits (see Req.reuse_limit).
            pages, node = self.tree.match_prefix(self.cache_key(req)[: req.reuse_limit])
            self.tree.inc_lock(node)
        req.slot = slot
        req.pages = list(pages)
        req.num_tree_pages = len(pages)
        req.prefix_node = node
        req.num_out_pages = 0
        req.window_node = node  # (a session turn: None, its released pages are freed)
        req.kv_len = len(pages) * self.page_size
        self._map(req, 0, pages)
        return True

    def allocate(self, req, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Make sure pages exist for ``req``'s next ``num_new_tokens`` plus ``num_lookahead_tokens``
        (speculative drafts, KV arriving from a connector), evicting cache if needed. All or nothing."""
        if req.sparse is not None and req.sparse.active:
            self.sparse.write_page(req, num_new_tokens + num_lookahead_tokens)
            return True
        need = self.pages_needed(req, num_new_tokens + num_lookahead_tokens)
        if need == 0:
            return True
        new = self._alloc_pages(need, f"req {req.rid}")
        if new is None:
            return False
        self._map(req, len(req.pages), new)
        req.pages.extend(new)
        return True

    def truncate(self, req, new_len: int) -> None:
        """Forget ``req``'s KV past ``new_len`` tokens (rejected drafts, unused lookahead) and give back
        the private pages past it. Borrowed pages are never given back here."""
        if new_len < (req.num_tree_pages + req.num_out_pages) * self.page_size:
            raise OwnershipError(
                f"req {req.rid}: truncating its KV to {new_len} tokens would give back borrowed or "
                f"out-of-window pages ({req.num_tree_pages} + {req.num_out_pages} of {self.page_size} tokens)"
            )
        req.kv_len = min(req.kv_len, new_len)
        keep = -(-new_len // self.page_size)  # >= num_tree_pages, by the check above
        if len(req.pages) > keep:
            self.free(req.pages[keep:], f"req {req.rid} truncate")
            del req.pages[keep:]

    # -- the one release path for request memory -------------------------------------------------------
    def release(self, req, commit: bool, final: bool = True) -> None:
        """Give back everything ``req`` holds.

        ``commit``: put its computed, page-aligned KV into the radix tree (pages already cached by
        someone else are freed as duplicates), or for a session turn make it the session's KV; the
        partial last page and any over-allocation are freed first (seed 004's tail trim). Without
        ``commit`` (an aborted turn, KV that must not be reused) every private page is freed.
        ``final``: the request ends here (False for a retraction or a failed admission).

        Every step runs whatever the one before did: a step that fails (HiSparse's release, a tree
        hook such as a tier's backup, a session's close) is logged and counted by ``Ledger.contain``,
        and the lock, the slot and the request's fields are given back all the same. What a failed
        step left unaccounted is the audit's to find (quarantined in production mode); strict mode
        raises the failure at the step's books check, after this release completed.
        """
        owner = f"req {req.rid}"
        if req.slot is None and req.pages:
            raise OwnershipError(f"{owner} holds {len(req.pages)} page entries but no slot")
        contain = self.ledger.contain
        if req.sparse is not None:
            # Its host and hot pages (HiSparse). Once it decodes sparsely its dense pages are gone
            # (the prompt cached at its first decode); its decoded KV lived in host pages only. A
            # session turn kept its dense pages: what they hold, the prompt's KV, goes to its session
            # (under PD, KV that prefill sent landed in host pages: only what its page list holds).
            if req.sparse.active and req.session is not None and req.slot is not None:
                req.kv_len = min(req.kv_len, req.sparse.begun_len, len(req.pages) * self.page_size)
            else:
                commit = commit and not req.sparse.active
            contain(f"{owner}: HiSparse release", self.sparse.release, req)
            req.sparse = None  # (after a failure, what it held is the audit's to find)
        if req.slot is not None:
            if req.session is not None:
                contain(f"{owner}: its session turn's pages", self.sessions.release_turn, req, commit, final)
            else:
                self._return_pages(req, commit, req.kv_len, owner)
            self.reset(req, owner)
        if req.session is not None and final:
            contain(f"{owner}: the end of its session turn", self.sessions.end_turn, req)

    def _return_pages(self, req, commit: bool, kv_len: int, owner: str) -> None:
        """``req``'s pages go back: with ``commit`` its first ``kv_len`` tokens' page-aligned KV into
        the tree (duplicates, the partial page and over-allocation freed), else its private pages
        freed; its lock on the borrowed prefix ends, even where the first part failed."""
        contain = self.ledger.contain
        contain(f"{owner}: commit or free its pages", self._give_back_pages, req, commit, kv_len, owner)
        if req.prefix_node is not None:
            contain(f"{owner}: unlock its prefix", self.tree.dec_lock, req.prefix_node)

    def _give_back_pages(self, req, commit: bool, kv_len: int, owner: str) -> None:
        ps = self.page_size
        first_private = req.num_tree_pages + req.num_out_pages
        if req.num_out_pages:
            # Sliding window: what is left of its KV continues the prefix its released pages went to.
            if commit and self.tree.enabled:
                self.window.commit(req, kv_len, owner)
            else:
                self.free(req.pages[first_private:], owner)
        elif commit and self.tree.enabled:
            aligned = kv_len // ps
            self.free(req.pages[aligned:], owner)  # partial page and over-allocation
            present = self.tree.insert(self.cache_key(req)[: aligned * ps], req.pages[:aligned]) // ps
            # [num_tree_pages, present): someone else cached the same tokens meanwhile -> duplicates.
            self.free(req.pages[first_private:present], owner)
            self.pages.set_owner(req.pages[max(present, first_private) : aligned], "radix")
        else:
            self.free(req.pages[first_private:], owner)

    def give_back_dense(self, req, kv_len: int) -> None:
        """A request now decoding sparsely (HiSparse) gives back its dense pages, its first ``kv_len``
        tokens (the prompt, copied to its host pages) cached as a finished prompt's would be; it keeps
        its slot, its host pages and its hot pages."""
        self._return_pages(req, req.kv_trusted, kv_len, f"req {req.rid}")
        forget_pages(req)

    def reset(self, req, owner: str) -> None:
        """Forget a request's memory fields once its pages are accounted for; frees its slot (a double
        free of it is reported, as one of pages)."""
        if not self.slots.free(req.slot, owner):
            self.ledger.contain(
                f"{owner}: its slot", self.report_double_free, [req.slot], owner, "request", "slot"
            )
        req.slot = None
        forget_pages(req)
        req.kv_len = 0


def _images(req) -> tuple | None:
    """A request's images (``multimodal.ImageItem``s), which key their tokens in the prefix cache."""
    mm = getattr(req, "mm", None)
    return mm.images if mm is not None else None
