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

import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ..errors import MemoryLedgerError, ReleaseError
from .pools import PagePool, ReqSlotPool
from .radix import RadixCache

log = logging.getLogger(__name__)


@dataclass
class Holding:
    """What one live request or session holds, as the ledger sees it."""

    owner: str  # e.g. "req abc" or "session s1"
    kind: str  # "request" | "session" | "hisparse_hot" | "hisparse_host" | "reserved"
    own_pages: Sequence[int]  # PRIVATE (request) or SESSION (session) pages
    borrowed_pages: Sequence[int] = ()  # pages read, owned by someone else
    slot: int | None = None
    borrowed_from: str | None = None  # None: the radix tree (under a lock); else the owning session
    host_pages: Sequence[int] = ()  # L2 pages (hierarchical cache): a demoted idle session's KV
    kv_tokens: int | None = None  # a session: the tokens whose KV its L1 pages hold (exactly their pages)
    sparse_host_pages: Sequence[int] = ()  # HiSparse host-pool pages (a sparse request's KV history)
    out_of_window: int = 0  # page entries given back out of window (sliding windows), not held
    entries: int | None = None  # a request: its page entries (borrowed + out of window + own)
    kv_len: int | None = None  # a request: the tokens whose KV is computed


T = TypeVar("T")


@dataclass
class AuditReport:
    leaked_pages: dict[int, str] = field(default_factory=dict)  # page -> its last owner
    double_pages: dict[int, list[str]] = field(default_factory=dict)  # page -> its owners
    leaked_slots: dict[int, str] = field(default_factory=dict)
    double_slots: dict[int, list[str]] = field(default_factory=dict)
    leaked_host_pages: dict[int, str] = field(default_factory=dict)  # L2 (hierarchical cache)
    double_host_pages: dict[int, list[str]] = field(default_factory=dict)
    leaked_sparse_host_pages: dict[int, str] = field(default_factory=dict)  # HiSparse's host pool
    double_sparse_host_pages: dict[int, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def _parts(self) -> tuple:
        return (
            self.leaked_pages,
            self.double_pages,
            self.leaked_slots,
            self.double_slots,
            self.leaked_host_pages,
            self.double_host_pages,
            self.leaked_sparse_host_pages,
            self.double_sparse_host_pages,
            self.problems,
        )

    @property
    def ok(self) -> bool:
        return not any(self._parts())

    @property
    def num_violations(self) -> int:
        return sum(len(p) for p in self._parts())

    def describe(self, limit: int = 20) -> str:
        parts = []

        def show(title: str, d: dict) -> None:
            if d:
                items = list(d.items())
                text = ", ".join(f"{k} ({v})" for k, v in items[:limit])
                more = f", ... {len(items) - limit} more" if len(items) > limit else ""
                parts.append(f"{title} {len(items)}: {text}{more}")

        show("leaked pages (last owner)", self.leaked_pages)
        show("pages with several owners", self.double_pages)
        show("leaked request slots (last owner)", self.leaked_slots)
        show("request slots with several owners", self.double_slots)
        show("leaked L2 pages (last owner)", self.leaked_host_pages)
        show("L2 pages with several owners", self.double_host_pages)
        show("leaked HiSparse host pages (last owner)", self.leaked_sparse_host_pages)
        show("HiSparse host pages with several owners", self.double_sparse_host_pages)
        parts.extend(self.problems[:limit])
        return "; ".join(parts) if parts else "ok"


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

    # -- figures ----------------------------------------------------------------------------------
    def page_counts(self) -> dict[str, int]:
        private = session = hot = reserved = 0
        slots_used = 0
        for h in self.holdings():
            if h.kind == "session":
                session += len(h.own_pages)
            elif h.kind == "hisparse_hot":
                hot += len(h.own_pages)
            elif h.kind == "reserved":
                reserved += len(h.own_pages)
            else:
                private += len(h.own_pages)
            slots_used += h.slot is not None
        return {
            "free": self.pages.num_free,
            "cached_evictable": self.tree.evictable_pages,
            "cached_protected": self.tree.protected_pages,
            "private": private,
            "session": session,
            "hisparse_hot": hot,
            "reserved": reserved,
            "quarantined": self.pages.num_quarantined,
            "slots_used": slots_used,
            "slots_quarantined": self.slots.num_quarantined,
        }

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
        """The pool as runs of consecutive pages with one owner: ``{start, count, kind, owner}``, kind
        one of free / cached_evictable / cached_protected / private / session / hisparse_hot / reserved /
        quarantined (the figures' names; a quarantined page's owner is ``quarantine (last owner: X)``),
        or ``unowned`` for a page nobody's books hold (a leak; its owner is the last one on record).
        The counts of each kind times the page size are the figures' ``kv_*`` (same instant)."""
        n = self.pages.num_pages
        kind: list[str | None] = [None] * n
        owner: list[str | None] = [None] * n
        for p in self.pages.free_list():
            kind[p] = "free"
        for p in self.pages.quarantined:
            kind[p], owner[p] = "quarantined", self.pages.last_owner[p]
        for node in self.tree.nodes():
            k = "cached_protected" if node.lock_ref > 0 else "cached_evictable"
            for p in node.pages:
                kind[p], owner[p] = k, node.owner
        for h in self.holdings():
            k = h.kind if h.kind in ("session", "hisparse_hot", "reserved") else "private"
            for p in h.own_pages:
                kind[p], owner[p] = k, h.owner
        runs: list[dict] = []
        for p in range(n):
            k, o = kind[p], owner[p]
            if k is None:
                k, o = "unowned", self.pages.last_owner[p]
            last = runs[-1] if runs else None
            if last is not None and last["kind"] == k and last["owner"] == o:
                last["count"] += 1
            else:
                runs.append({"start": p, "count": 1, "kind": k, "owner": o})
        return runs

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
        owners = _Owners()
        owners.add("free", self.pages.free_list())
        protected_pages: set[int] = set()  # pages of protected tree nodes (what borrowers may read)
        evictable = protected = 0
        for node in self.tree.nodes():
            if node.lock_ref > 0:
                owners.add("cached/protected", node.pages)
                protected_pages.update(node.pages)
                protected += len(node.pages)
            else:
                owners.add("cached/evictable", node.pages)
                evictable += len(node.pages)
            if node.lock_ref < 0:
                report.problems.append(f"radix node with negative lock count {node.lock_ref}")
        if (evictable, protected) != (self.tree.evictable_pages, self.tree.protected_pages):
            report.problems.append(
                f"radix counters say evictable {self.tree.evictable_pages} / protected "
                f"{self.tree.protected_pages}, the tree holds {evictable} / {protected}"
            )
        slot_owners: dict[int, list[str]] = defaultdict(list)
        for s in self.slots.free_list():
            slot_owners[s].append("free")
        holdings = list(self.holdings())
        session_pages: dict[str, set[int]] = {}
        for h in holdings:
            owners.add(h.owner if h.kind != "request" else f"private to {h.owner}", h.own_pages)
            if h.kind == "session":
                session_pages[h.owner] = set(h.own_pages)
            if h.slot is not None:
                slot_owners[h.slot].append(h.owner)
        ps = self.pages.page_size
        for h in holdings:
            # Seed 004: a session holds its KV's pages, no more (a speculative tail handed over with
            # the turn would be pages nobody reads and nobody frees until the session ends); pages
            # given back out of window count as entries it no longer holds.
            held = len(h.own_pages) + h.out_of_window
            if h.kv_tokens is not None and h.own_pages and held != -(-h.kv_tokens // ps):
                out = f" (and {h.out_of_window} out of window)" if h.out_of_window else ""
                report.problems.append(
                    f"{h.owner} holds {len(h.own_pages)} pages{out} for KV "
                    f"of {h.kv_tokens} tokens ({-(-h.kv_tokens // ps)} pages of {ps})"
                )
            if self.window is not None:  # (out-of-window entries exist only then)
                if any(p < 0 for p in h.own_pages):
                    report.problems.append(f"{h.owner} counts an out-of-window entry as a page it holds")
                report.problems.extend(self._window_problems(h))
            for p in h.borrowed_pages:
                if p < 0 and h.borrowed_from is not None:
                    continue  # a session's out-of-window entry: nothing is read there
                if h.borrowed_from is None and p not in protected_pages:
                    report.problems.append(f"{h.owner} reads page {p}, which the tree does not protect")
                elif h.borrowed_from is not None and p not in session_pages.get(h.borrowed_from, ()):
                    report.problems.append(f"{h.owner} reads page {p}, which {h.borrowed_from} does not hold")
        held_pages = owners.classify(
            self.pages.last_owner, report.leaked_pages, report.double_pages, self.pages.quarantined
        )
        held_slots = classify(
            slot_owners, self.slots.last_owner, report.leaked_slots, report.double_slots, self.slots.quarantined
        )
        if self.tiers is not None:
            self.tiers.audit(report, holdings)
        if self.sparse is not None:
            self.sparse.audit(report, holdings)
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
        for pool, held, what in ((self.pages, held_pages, "pages"), (self.slots, held_slots, "request slots")):
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

    def _window_problems(self, h: Holding) -> list[str]:
        """A sliding-window request: an entry for every token of its KV (held, borrowed or out of
        window), and nothing given back that the window of its next token still reads."""
        if h.entries is None or h.kv_len is None:
            return []
        ps, out = self.pages.page_size, []
        if h.entries < -(-h.kv_len // ps):
            out.append(f"{h.owner} has {h.entries} page entries for KV of {h.kv_len} tokens")
        end = len(h.borrowed_pages) + h.out_of_window
        if h.out_of_window and end > self.window.first_needed_page(h.kv_len):
            out.append(
                f"{h.owner} gave back pages up to {end} out of window, but the window of position "
                f"{h.kv_len} (W {self.window.window}) reads from page {self.window.first_needed_page(h.kv_len)}"
            )
        return out

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


class _Owners:
    """Owner lists of ids, counted in numpy: ``add`` each owner's ids, then ``classify``."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, Sequence[int]]] = []

    def add(self, label: str, ids: Sequence[int]) -> None:
        if len(ids):
            self.parts.append((label, ids))

    def classify(self, last_owner: list[str], leaked: dict, double: dict, quarantined: Container[int]) -> list[int]:
        """As ``classify``: ids with no owner are leaks (named by their last owner), with several
        doubles (with every owner's name); quarantined ids are no leaks. Returns the quarantined ids
        that have an owner."""
        n = len(last_owner)
        ids = np.fromiter(itertools.chain.from_iterable(ids for _, ids in self.parts), dtype=np.int64)
        ids = ids[ids >= 0]  # (an id outside the pool is not counted, as before)
        counts = np.bincount(ids, minlength=n) if ids.size else np.zeros(n, dtype=np.int64)
        for i in np.flatnonzero(counts[:n] == 0).tolist():
            if i not in quarantined:
                leaked[i] = last_owner[i]
        doubles = set(np.flatnonzero(counts[:n] > 1).tolist())
        if doubles:
            names: dict[int, list[str]] = defaultdict(list)
            for label, part in self.parts:
                for i in part:
                    if i in doubles:
                        names[i].append(label)
            double.update(names)
        return [i for i in quarantined if i < n and counts[i] > 0]


def classify(
    owners: dict[int, list[str]], last_owner: list[str], leaked: dict, double: dict, quarantined: Container[int] = ()
) -> list[int]:
    """Ids with no owner are leaks (named by their last owner), unless quarantined; with several,
    double ownership. Returns the quarantined ids that have an owner."""
    held = []
    for i in range(len(last_owner)):
        o = owners.get(i)
        if not o:
            if i not in quarantined:
                leaked[i] = last_owner[i]
        elif i in quarantined:
            held.append(i)
            if len(o) > 1:
                double[i] = o
        elif len(o) > 1:
            double[i] = o
    return held
