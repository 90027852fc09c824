"""The L2 tier's books, for the ledger: every L2 page is FREE, the copy of one radix node's tokens
(``radix node N``; sub-states *loading*: pinned by a load this step, and *storing*: being written to
L3), the target of one prefetch in flight (``prefetch for req X``), or the KV of one idle session
(``session S``). Conservation is checked every step in strict mode; the audit walks every owner.

L3 is content-addressed files: nothing in it can leak (a file is a key's value, not a holding). A file
op in flight holds its L2 pages under its own name (above) until every tensor-parallel rank has
reported it, and the engine is not idle until then (nor while ops wait to be shipped to the other
ranks), so the idle audit sees none. The books are rank 0's alone: an L2 page id means the same page
on every rank, and the other ranks only move the data rank 0's policy decided (``ops.py``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from ..memory.audit import AuditReport, Holding, classify


class TierBooks:
    def __init__(self, tiers, connector):
        self.tiers = tiers
        self.connector = connector

    def _session_pages(self, holdings: Iterable[Holding]) -> int:
        return sum(len(h.host_pages) for h in holdings)

    def figures(self, holdings: Iterable[Holding]) -> dict:
        return self.tiers.figures(self._session_pages(holdings))

    def conservation_problems(self, holdings: Iterable[Holding]) -> list[str]:
        t = self.tiers
        free, cached = t.host.num_free, t.tree.host_pages
        prefetching = sum(len(op.host_pages) for op in t.prefetcher.ops())
        session = self._session_pages(holdings)
        if free + cached + prefetching + session == t.host.num_pages:
            return []
        return [
            f"L2 conservation broken: free {free} + cached {cached} + prefetching {prefetching} + session "
            f"{session} = {free + cached + prefetching + session} != total {t.host.num_pages}"
        ]

    def audit(self, report: AuditReport, holdings: list[Holding]) -> None:
        t = self.tiers
        host = t.host
        owners: dict[int, list[str]] = defaultdict(list)
        for p in host.free_list():
            owners[p].append("free")
        tree_host: set[int] = set()
        walked = 0
        for node in t.tree.nodes():
            for p in node.host:
                owners[p].append(node.owner)
                tree_host.add(p)
            walked += len(node.host)
            if not node.pages and not node.host:
                report.problems.append(f"{node.owner} holds no KV in any tier")
            if node.host and len(node.host) * t.page_size != len(node.key):
                report.problems.append(f"{node.owner}: {len(node.host)} L2 pages for {len(node.key)} tokens")
            parent = node.parent
            if node.pages and parent is not t.tree.root and not parent.pages:
                report.problems.append(f"{node.owner} has L1 pages under {parent.owner}, which has none")
        if walked != t.tree.host_pages:
            report.problems.append(
                f"L2 counter says the tree holds {t.tree.host_pages} pages, it holds {walked}"
            )
        for op in t.prefetcher.ops():
            for p in op.host_pages:
                owners[p].append(op.owner)
        for h in holdings:
            for p in h.host_pages:
                owners[p].append(h.owner)
        classify(owners, host.last_owner, report.leaked_host_pages, report.double_host_pages)
        # Pins: exactly the loads pinned now; stores: exactly the store ops in flight.
        want = Counter(p for load in self.connector.live_loads() for p in load.host_pages)
        storing = {p for pages in t.stores.values() for p in pages}
        for p in range(host.num_pages):
            if host.pins[p] != want.get(p, 0):
                report.problems.append(f"L2 page {p} pinned {host.pins[p]} times by {want.get(p, 0)} loads")
            if bool(host.storing[p]) != (p in storing):
                report.problems.append(f"L2 page {p} storing flag {host.storing[p]} without a matching store")
            if (host.pins[p] or host.storing[p]) and p not in tree_host:
                report.problems.append(f"L2 page {p} is pinned but no radix node holds it")

    def reclaim(self, report: AuditReport) -> None:
        """Production: take back L2 pages nobody's books hold."""
        if report.leaked_host_pages:
            self.tiers.host.free(list(report.leaked_host_pages), by="ledger reclaim")
