"""The ledger: who owns each KV page and each request slot, checked cheaply every step and
recomputed from first principles when idle.

Page states: FREE (in the pool's free list), CACHED (in the radix tree; evictable when unlocked,
protected otherwise), PRIVATE (one live request's computed-but-uncached tail, over-allocation
included), SESSION (held by one streaming session), HISPARSE_HOT (a sparse-decoding request's hot
buffer, ``memory/sparse_kv.py``; its host pages are in their own pool, checked by ``SparseBooks``),
RESERVED (kept for the engine's life by a named component: the CUDA-graph runner's padding page,
``KVManager.reserve``), QUARANTINED (below). A request slot is free, used by one live request, held by
one session, or quarantined.
Live requests *borrow* cached pages (the tree still owns them; the request's lock keeps them
protected). With a sliding-window model, a request's or session's page list may have OUT OF WINDOW
entries (``memory/window.py``): pages given back, which it no longer holds; the audit checks that
they lie wholly outside the window of its KV.

Quarantine (production mode): a page or slot the audit finds with no owner on its books is not freed,
for the enumeration of owners may have missed one that still reads it (a freed page handed to another
request would then hold two requests' KV). It is QUARANTINED, owner ``quarantine (last owner: X)``:
counted (``kv_quarantined``, ``req_slots_quarantined``), shown in the page map, never handed out. It
leaves quarantine when its missed owner gives it back or shows up on the books again, or, proven
unowned, goes back to the free list: at an audit where no owner holds it and every request that was
live when it was quarantined has ended (at the latest, the next idle audit). Transient owners (KV
transfers, tier loads, steps in flight) all belong to requests, so none of them can still reach it;
the tree, sessions and reserved pages are walked by the audit itself.

Containment: a component that fails while memory is released (a release hook, a radix tree hook, one
step of ``KVManager.release``) never stops the release: ``contain`` runs each step, logs and counts a
failure (``leak_check.contained_errors``) and the release goes on; strict mode raises ``ReleaseError``
at the next books check, after the release completed.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TypeVar

from ..errors import MemoryLedgerError, ReleaseError
from .audit import (
    AuditReport,
    Holding,
    Owners,
    add_holdings,
    classify,
    holding_problems,
    page_counts,
    page_runs,
    walk_tree,
)
from .pools import PagePool, ReqSlotPool
from .radix import RadixCache

T = TypeVar("T")

log = logging.getLogger(__name__)


class Ledger:
    """Books of the KV page pool and the request-slot pool."""

    def __init__(
        self,
        pages: PagePool,
        slots: ReqSlotPool,
        tree: RadixCache,
        holdings: Callable[[], Iterable[Holding]],
        strict: bool,
        tiers=None,
        sparse=None,
    ):
        """``tiers``, ``sparse``: the books of the L2 tier (``hicache/books.py`` ``TierBooks``) and of
        HiSparse's host pool (``sparse_kv.py`` ``SparseBooks``), audited with these; None when off."""
        self.pages = pages
        self.slots = slots
        self.tree = tree
        self.holdings = holdings
        self.strict = strict
        self.checks = 0
        self.audit_seconds = 0.0  # all audits together (their cost), and the last one's
        self.last_audit_seconds = 0.0
        self.violations = 0
        self.quarantined_pages = 0  # pages put in quarantine, ever (production mode)
        self.quarantined_slots = 0
        self.reclaimed_pages = 0  # ... of them, freed once proven unowned
        self.reclaimed_slots = 0
        self.contained_errors = 0  # component failures a release went on through (``contain``)
        self._unraised: list[str] = []  # ... not yet raised (strict mode)
        # ``(newest request arrival so far, oldest arrival still live or None)``: the scheduler's, so
        # that quarantine can wait for every request live when it began (none here: a bare manager).
        self.arrivals: Callable[[], tuple[int, int | None]] = lambda: (0, None)
        self.last_report: AuditReport | None = None
        self.tiers = tiers
        self.sparse = sparse
        self.window = None  # memory/window.py WindowKV: a sliding-window model's releases
        # scheduler/images.py ImageBooks: image embeddings held between chunks (audited, figures)
        self.images = None

    # -- figures ----------------------------------------------------------------------------------
    def page_counts(self) -> dict[str, int]:
        """Pages by state and slots in use, from the pools, the tree's counters and the holders."""
        return page_counts(self.pages, self.slots, self.tree, self.holdings())

    def figures(self) -> dict:
        """The ``memory`` object of /get_server_info and ``Engine.memory()`` (in tokens)."""
        c = self.page_counts()
        ps = self.pages.page_size
        return {
            "page_size": ps,
            "kv_total": self.pages.num_pages * ps,
            "kv_free": c["free"] * ps,
            "kv_cached_evictable": c["cached_evictable"] * ps,
            "kv_cached_protected": c["cached_protected"] * ps,
            "kv_private": c["private"] * ps,
            "kv_session": c["session"] * ps,
            **({"kv_hisparse_hot": c["hisparse_hot"] * ps} if self.sparse is not None else {}),
            # Only where a component reserved pages (CUDA graphs): idle, free + cached_evictable +
            # session + reserved == total.
            **({"kv_reserved": c["reserved"] * ps} if c["reserved"] else {}),
            # Found unowned by a production-mode audit, held aside until proven unowned (never handed out).
            "kv_quarantined": c["quarantined"] * ps,
            "req_slots_total": self.slots.num_slots,
            "req_slots_free": self.slots.num_free,
            "req_slots_quarantined": c["slots_quarantined"],
            **({"hicache": self.tiers.figures(list(self.holdings()))} if self.tiers is not None else {}),
            **({"hisparse": self.sparse.figures(list(self.holdings()))} if self.sparse is not None else {}),
            **({"window": self.window.figures(list(self.holdings()))} if self.window is not None else {}),
            **(self.images.figures() if self.images is not None and self.images.used else {}),
            "leak_check": {
                "ok": self.violations == 0,
                "checks": self.checks,
                "violations": self.violations,
                "contained_errors": self.contained_errors,
                "quarantined_pages_total": self.quarantined_pages,
                "reclaimed_pages_total": self.reclaimed_pages,
                "quarantined_slots_total": self.quarantined_slots,
                "reclaimed_slots_total": self.reclaimed_slots,
            },
            # The audits' cost: the last one's and all of them together.
            "audit": {
                "last_ms": round(self.last_audit_seconds * 1000, 3),
                "seconds_total": round(self.audit_seconds, 3),
            },
        }

    def page_runs(self) -> list[dict]:
        """The pool as runs of consecutive pages with one owner (``memory/audit.py``'s ``page_runs``)."""
        return page_runs(self.pages, self.tree, self.holdings())

    # -- the cheap check (every step in strict mode) -----------------------------------------------
    def check_conservation(self) -> None:
        """``free + cached + private + session + hisparse_hot + reserved + quarantined == total`` (and
        the same for slots); first, in strict mode, any failure a release contained is raised."""
        self.raise_contained()
        c = self.page_counts()
        total = (
            c["free"] + c["cached_evictable"] + c["cached_protected"] + c["private"] + c["session"]
            + c["hisparse_hot"] + c["reserved"] + c["quarantined"]
        )  # fmt: skip
        problems = []
        if total != self.pages.num_pages:
            problems.append(
                f"page conservation broken: free {c['free']} + cached_evictable {c['cached_evictable']} + "
                f"cached_protected {c['cached_protected']} + private {c['private']} + session {c['session']}"
                f" + hisparse_hot {c['hisparse_hot']} + reserved {c['reserved']} + quarantined"
                f" {c['quarantined']} = {total} != total {self.pages.num_pages}"
            )
        if self.slots.num_free + c["slots_used"] + c["slots_quarantined"] != self.slots.num_slots:
            problems.append(
                f"slot conservation broken: free {self.slots.num_free} + used {c['slots_used']} + quarantined"
                f" {c['slots_quarantined']} != total {self.slots.num_slots}"
            )
        if self.tiers is not None:
            problems.extend(self.tiers.conservation_problems(list(self.holdings())))
        if self.sparse is not None:
            problems.extend(self.sparse.conservation_problems(list(self.holdings())))
        if problems:
            report = self.audit(count=False)
            report.problems[:0] = problems
            self._enforce(report)

    # -- the full audit (when idle) ----------------------------------------------------------------
    def audit(self, count: bool = True) -> AuditReport:
        """Recompute every page's and slot's owners from the free lists, the tree and the holders.

        Pages are counted in numpy (one owner each, or it is a leak / a double): a default pool has
        ~10^5 pages, and a dict of owner lists per page took ~200 ms of the engine loop (GC included)
        each time it went idle, a delay the next request paid. Names are gathered only for the ids
        found leaked or doubly owned.

        A quarantined id is not an owner: with an owner on the books it leaves quarantine (that owner
        is back), without one it stays, and is freed once proven unowned (``count``: a real audit;
        the module docstring). Only ids not yet quarantined are reported as leaks."""
        if count:
            self.raise_contained()
        t0 = time.perf_counter()
        report = AuditReport()
        owners = Owners()
        owners.add("free", self.pages.free_list())
        protected_pages = walk_tree(self.tree, owners, report)
        slot_owners: dict[int, list[str]] = defaultdict(list)
        for s in self.slots.free_list():
            slot_owners[s].append("free")
        holdings = list(self.holdings())
        session_pages = add_holdings(holdings, owners, slot_owners)
        report.problems.extend(
            holding_problems(holdings, self.pages.page_size, self.window, protected_pages, session_pages)
        )
        held_pages = owners.classify(
            self.pages.last_owner, report.leaked_pages, report.double_pages, self.pages.quarantined
        )
        held_slots = classify(
            slot_owners,
            self.slots.last_owner,
            report.leaked_slots,
            report.double_slots,
            self.slots.quarantined,
        )
        if self.tiers is not None:
            self.tiers.audit(report, holdings)
        if self.sparse is not None:
            self.sparse.audit(report, holdings)
        if self.images is not None:
            self.images.audit(report, holdings)
        if count:
            self.checks += 1
            self._settle_quarantine(held_pages, held_slots)
            self.last_audit_seconds = time.perf_counter() - t0
            self.audit_seconds += self.last_audit_seconds
            self._enforce(report)
        return report

    def _settle_quarantine(self, held_pages: list[int], held_slots: list[int]) -> None:
        """Quarantined ids an owner holds again leave quarantine; those nobody holds are freed once
        every request live when they were quarantined has ended (``arrivals``)."""
        _newest, oldest_live = self.arrivals()
        for pool, held, what in (
            (self.pages, held_pages, "pages"),
            (self.slots, held_slots, "request slots"),
        ):
            if not pool.quarantined:
                continue
            if held:
                pool.unquarantine(held)
                log.warning("quarantined %s %s have an owner on the books again", what, held[:20])
            proven = [i for i, w in pool.quarantined.items() if oldest_live is None or oldest_live > w]
            if proven:
                pool.release_quarantined(proven, "ledger reclaim (proven unowned)")
                if pool is self.pages:
                    self.reclaimed_pages += len(proven)
                else:
                    self.reclaimed_slots += len(proven)
                log.warning("freed quarantined %s %s: proven unowned", what, proven[:20])

    # -- containment: a release never stops in the middle ---------------------------------------------
    def contain(self, what: str, fn: Callable[..., T], *args) -> T | None:
        """Run one step of a release (a component's hook, a part of ``KVManager.release``): a failure
        is logged and counted, and the caller goes on with the next step (the result is then None);
        strict mode raises it later (``raise_contained``), once the release has completed (a double
        free the step reported in strict mode too)."""
        try:
            return fn(*args)
        except Exception as e:
            self.contained_errors += 1
            log.exception("%s failed; the release goes on", what)
            if self.strict:
                self._unraised.append(f"{what}: {type(e).__name__}: {e}")
            return None

    def raise_contained(self) -> None:
        """Strict mode: raise the failures releases went on through since the last call (at the books
        check after the step, so no output is lost and each release has completed)."""
        if self._unraised:
            errors, self._unraised = self._unraised, []
            raise ReleaseError("a release completed through failures: " + "; ".join(errors[:20]))

    def _enforce(self, report: AuditReport) -> None:
        self.last_report = report
        if report.ok:
            return
        self.violations += report.num_violations
        msg = f"memory ledger violation: {report.describe()}"
        if self.strict:
            raise MemoryLedgerError(msg)
        # Production: one bug must not take every user down. Log it, count it, hold what nobody's
        # books hold aside (quarantine: the owner the walk missed may still read it; freed once proven
        # unowned, never handed out before), and keep serving.
        log.error("%s (quarantining orphans, serving on)", msg)
        newest, _oldest = self.arrivals()
        if report.leaked_pages:
            self.pages.quarantine(list(report.leaked_pages), newest)
            self.quarantined_pages += len(report.leaked_pages)
        if report.leaked_slots:
            self.slots.quarantine(list(report.leaked_slots), newest)
            self.quarantined_slots += len(report.leaked_slots)
        if self.tiers is not None:
            self.tiers.reclaim(report)
        if self.sparse is not None:
            self.sparse.reclaim(report)
