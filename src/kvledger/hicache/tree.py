"""The radix tree over the tiers: nodes know whether their KV is in L1 (``pages``), L2 (``host``) or
both; L3 is content-addressed (``storage.py``) and needs no node.

Invariants (checked by the audit):
  * L1 is closed under prefixes: a node with L1 pages has a parent with L1 pages (or the root). So
    the L1 match stops at the first node without them, and what follows is the L2 part.
  * Every node holds L1 pages, L2 pages, or both; one with neither is deleted at once.
  * A pinned L2 page (a load reading it, a store writing it to L3) is never freed.

L1 eviction (``evict``) takes unlocked L1 leaves (no child with L1 pages), least recently used first:
a node with an L2 copy loses only its L1 pages; without one it is demoted first under write_back, and
otherwise deleted with its L2-only subtree. L2 eviction (``evict_host``) takes nodes with no L1 pages
and no children: their pages are already in L3 when storage is on (stores follow every backup), so
they are dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from ..errors import OwnershipError
from ..memory.radix import RadixCache, TreeNode


class HiRadixCache(RadixCache):
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None], tiers):
        super().__init__(page_size, free_pages, enabled=True)
        self.tiers = tiers  # hicache/tiers.py: L2 allocation, backups, stores
        self.host_pages = 0  # L2 pages held by nodes (the books check it against a walk)

    # -- hooks from the plain tree ----------------------------------------------------------------
    def _hit(self, node: TreeNode) -> None:
        node.hit_count += 1
        if not node.host and node.hit_count >= self.tiers.backup_threshold:
            self.tiers.backup(node)

    def _inserted(self, node: TreeNode) -> None:
        node.hit_count = 1
        if self.tiers.backup_threshold <= 1:
            self.tiers.backup(node)

    # -- L2 bookkeeping -----------------------------------------------------------------------------
    def attach_host(self, node: TreeNode, host: list[int]) -> None:
        if node.host or len(host) * self.page_size != len(node.key):
            raise OwnershipError(
                f"{node.owner} is given {len(host)} L2 pages for {len(node.key)} tokens while it holds "
                f"{len(node.host)}: the tree would own L2 pages that hold none of its tokens, or lose some"
            )
        node.host = host
        self.host_pages += len(host)
        self.tiers.host.set_owner(host, node.owner)

    def _drop_host(self, node: TreeNode) -> None:
        if node.host:
            self.host_pages -= len(node.host)
            self.tiers.host_free(node.host, node.owner)
            node.host = []

    def _delete(self, node: TreeNode) -> int:
        """Remove ``node`` and its subtree (whose nodes hold only L2 pages); returns L1 pages freed."""
        freed = 0
        for child in list(node.children.values()):
            freed += self._delete(child)
        parent = node.parent
        assert parent is not None  # type narrowing only: a node in the tree has a parent
        del parent.children[self._child_key(node.key, 0)]
        if node.pages:
            self._count_pages(node, -len(node.pages))
            freed += len(node.pages)
            self._free_pages(node.pages)
            node.pages = []
        self._drop_host(node)
        return freed

    def _subtree_pinned(self, node: TreeNode) -> bool:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host and self.tiers.host.pinned(n.host):
                return True
            stack.extend(n.children.values())
        return False

    @staticmethod
    def _l1_leaf(node: TreeNode) -> bool:
        return bool(node.pages) and not any(c.pages for c in node.children.values())

    # -- matching beyond L1 -------------------------------------------------------------------------
    def match_host(self, node: TreeNode, tokens: list[int], at: int) -> tuple[list[int], TreeNode]:
        """Continue a match from ``node`` (after ``at`` tokens) through nodes that hold an L2 copy but
        no L1 pages: (their L2 pages, the deepest such node). Whole nodes only: a partly matched node
        is split first, so a load is all-or-nothing per node."""
        host: list[int] = []
        for node in self.descend(node, tokens, at, lambda c: not c.pages and bool(c.host)):  # noqa: B020
            node.hit_count += 1
            host.extend(node.host)
        return host, node

    def covered(self, tokens: list[int]) -> int:
        """Leading tokens of ``tokens`` whose KV some node holds (L1 or L2), page-aligned; no change
        to the tree (the L3 prefetch asks this before it looks at files)."""
        node, at = self.root, 0
        while len(tokens) - at >= self.page_size:
            child = node.children.get(self._child_key(tokens, at))
            if child is None:
                break
            m = self._match_len(child.key, tokens, at)
            at += m
            if m < len(child.key):
                break
            node = child
        return at

    def insert_host(self, tokens: list[int], host: list[int], start: int) -> list[int]:
        """Put prefetched L2 pages (``host``: tokens ``[start, len(tokens))``) into the tree as L2
        copies. The path ``tokens[:start]`` must still be in the tree (it may have been evicted while
        the files were read: then nothing is inserted). Returns the pages not used (the caller frees
        them): duplicates of copies the tree already has, or all of them."""
        ps = self.page_size
        used: set[int] = set()

        def take(a: int, b: int) -> list[int]:
            idx = range((a - start) // ps, (b - start) // ps)
            used.update(idx)
            return [host[i] for i in idx]

        node, at = self.root, 0
        now = self._tick()
        while at < len(tokens):
            child = node.children.get(self._child_key(tokens, at))
            if child is None:
                if at < start:
                    return host  # the path to the prefetched pages is gone
                leaf = TreeNode(key=tokens[at:], parent=node, last_access=now)
                node.children[self._child_key(tokens, at)] = leaf
                self.attach_host(leaf, take(at, len(tokens)))
                break
            m = self._match_len(child.key, tokens, at)
            if at < start < at + m:
                m = start - at  # a node across the start: split there, the rest is prefetched
            if m < len(child.key):
                child = self._split(child, m)
            if at >= start and not child.host:
                self.attach_host(child, take(at, at + m))  # a node with only L1 pages gets its copy
            child.last_access = now
            at += m
            node = child
        return [p for i, p in enumerate(host) if i not in used]

    # -- eviction -----------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages (fewer if not possible), demoting or deleting."""
        leaves = [n for n in self.nodes() if n.lock_ref == 0 and self._l1_leaf(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            node = heapq.heappop(leaves)
            if not node.host and self.tiers.write_back:
                self.tiers.backup(node)  # write_back: the copy is made on the way out
            parent = node.parent
            assert parent is not None  # type narrowing only: a node in the tree has a parent
            if node.host:
                pages, node.pages = node.pages, []
                self._count_pages(node, -len(pages))
                self._free_pages(pages)
                freed += len(pages)
                self.tiers.stats.l1_demoted_pages += len(pages)
            elif self._subtree_pinned(node):
                continue  # a load reads one of its L2-only descendants this step
            else:
                freed += self._delete(node)
            if parent is not self.root and parent.lock_ref == 0 and self._l1_leaf(parent):
                heapq.heappush(leaves, parent)
        return freed

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L2 pages from nodes with no L1 pages and no children."""
        leaves = [
            n
            for n in self.nodes()
            if n.host and not n.pages and not n.children and not self.tiers.host.pinned(n.host)
        ]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            node = heapq.heappop(leaves)
            parent = node.parent
            freed += len(node.host)
            self.tiers.stats.l2_evicted_pages += len(node.host)
            self._delete(node)
            if (
                parent is not None
                and parent is not self.root
                and parent.host
                and not parent.pages
                and not parent.children
                and not self.tiers.host.pinned(parent.host)
            ):
                heapq.heappush(leaves, parent)
        return freed

    def flush(self) -> int:
        """Delete every node no request locks and no load or store pins (``/flush_cache``): L1 and
        L2 both; L3 files stay (they are the persistent tier). Returns the L1 pages freed."""
        freed = 0
        for node in list(self.root.children.values()):
            freed += self._flush(node)
        return freed

    def _flush(self, node: TreeNode) -> int:
        freed = 0
        for child in list(node.children.values()):
            freed += self._flush(child)
        if node.lock_ref == 0 and not node.children and not (node.host and self.tiers.host.pinned(node.host)):
            freed += self._delete(node)
        return freed

    def path_tokens(self, node: TreeNode) -> list[int]:
        """Every token from the root to the end of ``node``."""
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return [t for part in reversed(parts) for t in part]
