"""The ledger's audit, apart from its books: what a holder reports (``Holding``), what an audit finds
(``AuditReport``), and the walks that recompute every page's owners from the tree and the holders
(``memory/ledger.py``'s ``Ledger.audit`` runs them; ``hicache/books.py`` and ``memory/sparse_kv.py``
audit their own pools into the same report)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .pools import PagePool, ReqSlotPool
from .radix import RadixCache


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


def page_counts(
    pages: PagePool, slots: ReqSlotPool, tree: RadixCache, holdings: Iterable[Holding]
) -> dict[str, int]:
    """Pages by state (free, cached, private, session, HiSparse hot, reserved, quarantined) and slots."""
    private = session = hot = reserved = 0
    slots_used = 0
    for h in holdings:
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
        "free": pages.num_free,
        "cached_evictable": tree.evictable_pages,
        "cached_protected": tree.protected_pages,
        "private": private,
        "session": session,
        "hisparse_hot": hot,
        "reserved": reserved,
        "quarantined": pages.num_quarantined,
        "slots_used": slots_used,
        "slots_quarantined": slots.num_quarantined,
    }


def page_runs(pages: PagePool, tree: RadixCache, holdings: Iterable[Holding]) -> list[dict]:
    """The pool as runs of consecutive pages with one owner: ``{start, count, kind, owner}``, kind
    one of free / cached_evictable / cached_protected / private / session / hisparse_hot / reserved /
    quarantined (the figures' names; a quarantined page's owner is ``quarantine (last owner: X)``),
    or ``unowned`` for a page nobody's books hold (a leak; its owner is the last one on record).
    The counts of each kind times the page size are the figures' ``kv_*`` (same instant)."""
    n = pages.num_pages
    kind: list[str | None] = [None] * n
    owner: list[str | None] = [None] * n
    for p in pages.free_list():
        kind[p] = "free"
    for p in pages.quarantined:
        kind[p], owner[p] = "quarantined", pages.last_owner[p]
    for node in tree.nodes():
        k = "cached_protected" if node.lock_ref > 0 else "cached_evictable"
        for p in node.pages:
            kind[p], owner[p] = k, node.owner
    for h in holdings:
        k = h.kind if h.kind in ("session", "hisparse_hot", "reserved") else "private"
        for p in h.own_pages:
            kind[p], owner[p] = k, h.owner
    runs: list[dict] = []
    for p in range(n):
        k, o = kind[p], owner[p]
        if k is None:
            k, o = "unowned", pages.last_owner[p]
        last = runs[-1] if runs else None
        if last is not None and last["kind"] == k and last["owner"] == o:
            last["count"] += 1
        else:
            runs.append({"start": p, "count": 1, "kind": k, "owner": o})
    return runs


def walk_tree(tree: RadixCache, owners: Owners, report: AuditReport) -> set[int]:
    """The tree's pages as owners (protected or evictable nodes), its counters checked against the
    nodes; returns the pages of protected nodes (what borrowers may read)."""
    protected_pages: set[int] = set()
    evictable = protected = 0
    for node in tree.nodes():
        if node.lock_ref > 0:
            owners.add("cached/protected", node.pages)
            protected_pages.update(node.pages)
            protected += len(node.pages)
        else:
            owners.add("cached/evictable", node.pages)
            evictable += len(node.pages)
        if node.lock_ref < 0:
            report.problems.append(f"radix node with negative lock count {node.lock_ref}")
    if (evictable, protected) != (tree.evictable_pages, tree.protected_pages):
        report.problems.append(
            f"radix counters say evictable {tree.evictable_pages} / protected "
            f"{tree.protected_pages}, the tree holds {evictable} / {protected}"
        )
    return protected_pages


def add_holdings(
    holdings: list[Holding], owners: Owners, slot_owners: dict[int, list[str]]
) -> dict[str, set[int]]:
    """Each holder's own pages and slot as owners; returns each session's pages (what a request
    borrowing from it may read)."""
    session_pages: dict[str, set[int]] = {}
    for h in holdings:
        owners.add(h.owner if h.kind != "request" else f"private to {h.owner}", h.own_pages)
        if h.kind == "session":
            session_pages[h.owner] = set(h.own_pages)
        if h.slot is not None:
            slot_owners[h.slot].append(h.owner)
    return session_pages


def holding_problems(
    holdings: list[Holding], ps: int, window, protected_pages: set[int], session_pages: dict[str, set[int]]
) -> list[str]:
    """What each holder's own books get wrong: a session holding more pages than its KV needs, a
    sliding window's entries (``window``: memory/window.py's WindowKV, or None), a borrowed page its
    lender does not hold."""
    problems: list[str] = []
    for h in holdings:
        # Seed 004: a session holds its KV's pages, no more (a speculative tail handed over with
        # the turn would be pages nobody reads and nobody frees until the session ends); pages
        # given back out of window count as entries it no longer holds.
        held = len(h.own_pages) + h.out_of_window
        if h.kv_tokens is not None and h.own_pages and held != -(-h.kv_tokens // ps):
            out = f" (and {h.out_of_window} out of window)" if h.out_of_window else ""
            problems.append(
                f"{h.owner} holds {len(h.own_pages)} pages{out} for KV "
                f"of {h.kv_tokens} tokens ({-(-h.kv_tokens // ps)} pages of {ps})"
            )
        if window is not None:  # (out-of-window entries exist only then)
            if any(p < 0 for p in h.own_pages):
                problems.append(f"{h.owner} counts an out-of-window entry as a page it holds")
            problems.extend(window_problems(h, ps, window))
        for p in h.borrowed_pages:
            if p < 0 and h.borrowed_from is not None:
                continue  # a session's out-of-window entry: nothing is read there
            if h.borrowed_from is None and p not in protected_pages:
                problems.append(f"{h.owner} reads page {p}, which the tree does not protect")
            elif h.borrowed_from is not None and p not in session_pages.get(h.borrowed_from, ()):
                problems.append(f"{h.owner} reads page {p}, which {h.borrowed_from} does not hold")
    return problems


def window_problems(h: Holding, ps: int, window) -> list[str]:
    """A sliding-window request: an entry for every token of its KV (held, borrowed or out of
    window), and nothing given back that the window of its next token still reads."""
    if h.entries is None or h.kv_len is None:
        return []
    out: list[str] = []
    if h.entries < -(-h.kv_len // ps):
        out.append(f"{h.owner} has {h.entries} page entries for KV of {h.kv_len} tokens")
    end = len(h.borrowed_pages) + h.out_of_window
    if h.out_of_window and end > window.first_needed_page(h.kv_len):
        out.append(
            f"{h.owner} gave back pages up to {end} out of window, but the window of position "
            f"{h.kv_len} (W {window.window}) reads from page {window.first_needed_page(h.kv_len)}"
        )
    return out


class Owners:
    """Owner lists of ids, counted in numpy: ``add`` each owner's ids, then ``classify``."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, Sequence[int]]] = []

    def add(self, label: str, ids: Sequence[int]) -> None:
        if len(ids):
            self.parts.append((label, ids))

    def classify(
        self, last_owner: list[str], leaked: dict, double: dict, quarantined: Container[int]
    ) -> list[int]:
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
    owners: dict[int, list[str]],
    last_owner: list[str],
    leaked: dict,
    double: dict,
    quarantined: Container[int] = (),
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
