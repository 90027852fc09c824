"""Radix prefix cache over page-aligned token sequences.

Each node holds a run of tokens (a multiple of ``page_size``) and the KV pages that hold them. A node
with ``lock_ref > 0`` is *protected* (some live request reads it); otherwise it is *evictable*, and
unlocked leaves are evicted least recently used first. The tree owns its pages: it is the only one
that frees them (on eviction or flush).

With the hierarchical cache (``hicache/tree.py``) a node may also hold a host (L2) copy, ``host``,
and may have lost its L1 ``pages``: L1 stays closed under prefixes (a node with L1 pages has a parent
with L1 pages), so the L1 match stops at the first node without them and a longer match continues
in L2. The plain tree never has such nodes; the hooks below are no-ops in it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import OwnershipError

_node_ids = itertools.count(1)


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    host: list[int] = field(default_factory=list)  # L2 pages of the same tokens (hierarchical cache)
    hit_count: int = 0  # requests that matched or inserted it (write_through_selective)
    id: int = field(default_factory=lambda: next(_node_ids))  # names the node in the ledger's page map

    @property
    def owner(self) -> str:
        return f"radix node {self.id}"

    def __lt__(self, other: TreeNode) -> bool:  # for the eviction heap
        return self.last_access < other.last_access


class RadixCache:
    """Prefix cache. ``free_pages`` is called with the pages of evicted nodes."""

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None], enabled: bool = True):
        self.page_size = page_size
        self.enabled = enabled
        self._free_pages = free_pages
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        # Runs a hook of the hierarchical cache (``_hit``, ``_inserted``) so that a failing one (a tier's
        # backup) never stops the tree's own operation: ``KVManager`` sets ``Ledger.contain`` (log,
        # count, strict mode raises it at the step's books check).
        self.contain: Callable[..., object] = lambda what, fn, *args: fn(*args)
        self.evictable_pages = 0
        self.protected_pages = 0
        self._clock = 0

    # -- helpers ----------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, tokens: list[int], at: int) -> tuple[int, ...]:
        return tuple(tokens[at : at + self.page_size])

    def _match_len(self, key: list[int], tokens: list[int], at: int) -> int:
        """Length of the common prefix of ``key`` and ``tokens[at:]``, rounded down to whole pages."""
        n = min(len(key), len(tokens) - at)
        i = 0
        while i < n and key[i] == tokens[at + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after ``at`` tokens (page-aligned); returns the new upper node."""
        ps = self.page_size
        upper = TreeNode(
            key=node.key[:at],
            pages=node.pages[: at // ps],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            host=node.host[: at // ps],
            hit_count=node.hit_count,
        )
        assert node.parent is not None  # type narrowing only: the root (no parent) has no key to split
        node.parent.children[self._child_key(upper.key, 0)] = upper
        node.key = node.key[at:]
        node.pages = node.pages[at // ps :]
        node.host = node.host[at // ps :]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    # -- public API -------------------------------------------------------------------------------
    def descend(
        self, node: TreeNode, tokens: list[int], at: int, take: Callable[[TreeNode], bool]
    ) -> Iterator[TreeNode]:
        """Follow ``tokens[at:]`` down from ``node`` through the children ``take`` accepts, yielding
        each matched node whole (a partly matched one is split first) with its access time updated."""
        now = self._tick()
        while len(tokens) - at >= self.page_size:
            child = node.children.get(self._child_key(tokens, at))
            if child is None or not take(child):
                return
            m = self._match_len(child.key, tokens, at)
            if m == 0:
                return
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            yield child
            at += m
            node = child

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        """Longest cached page-aligned prefix of ``tokens``: (its pages, the deepest node matched)."""
        node, pages = self.root, []
        if not self.enabled:
            return pages, node
        # A node without L1 pages ends the match: the rest is the host tier's (hicache/tree.py).
        for node in self.descend(self.root, tokens, 0, lambda c: bool(c.pages)):
            self.contain("radix tree hook (hit)", self._hit, node)
            pages.extend(node.pages)
        return pages, node

    def peek(self, tokens: list[int]) -> tuple[int, TreeNode]:
        """What ``match_prefix`` would match, without touching the tree (no split, no access time, no
        hit): the matched token count and the deepest node reached (a partly matched node counts; its
        requests share at least a page with it). For ordering the waiting queue."""
        node, at = self.root, 0
        if not self.enabled:
            return 0, node
        while len(tokens) - at >= self.page_size:
            child = node.children.get(self._child_key(tokens, at))
            if child is None or not child.pages:
                break
            m = self._match_len(child.key, tokens, at)
            if m == 0:
                break
            node, at = child, at + m
            if m < len(child.key):
                break
        return at, node

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Insert a page-aligned run; returns how many leading tokens were already cached in L1.

        The caller still owns ``pages`` for that already-cached prefix (duplicates) and must free
        them; the pages of the rest now belong to the tree: a new leaf, or nodes that had only a
        host copy (hierarchical cache), which take them as their L1 pages.
        """
        return self.insert_below(self.root, tokens, pages)[0]

    def insert_below(self, node: TreeNode, tokens: list[int], pages: list[int]) -> tuple[int, TreeNode]:
        """``insert`` of a run that continues the path ending at ``node`` (``tokens`` follow that
        path's tokens): returns the leading tokens of the run already cached in L1, and the node the
        run ends at. ``node`` must be the root or hold L1 pages (``holds_path``). Sliding windows
        (``memory/window.py``) extend a request's released prefix this way without walking it again."""
        if len(tokens) % self.page_size or len(pages) * self.page_size != len(tokens):
            raise OwnershipError(
                f"radix insert of {len(tokens)} tokens with {len(pages)} pages of {self.page_size}: the "
                "tree would own pages that hold none of its tokens, or tokens without pages"
            )
        if not self.enabled or not tokens:
            return 0, node
        ps = self.page_size
        at, present = 0, 0
        now = self._tick()
        while at < len(tokens):
            child = node.children.get(self._child_key(tokens, at))
            if child is None:
                leaf = TreeNode(key=tokens[at:], pages=pages[at // ps :], parent=node, last_access=now)
                node.children[self._child_key(tokens, at)] = leaf
                self.evictable_pages += len(leaf.pages)
                self.contain("radix tree hook (new leaf)", self._inserted, leaf)
                return present, leaf
            m = self._match_len(child.key, tokens, at)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            if child.pages:
                present = at + m  # L1 is closed under prefixes: every node so far had pages too
            else:
                child.pages = pages[at // ps : (at + m) // ps]  # adopted: L2 node gets its L1 back
                self._count_pages(child, len(child.pages))
            at += m
            node = child
        return present, node

    def holds_path(self, node: TreeNode) -> bool:
        """``node`` is still in the tree with its L1 pages (not evicted, not demoted to L2): the root,
        or a node its parent still lists and that has pages. Eviction removes only leaves, so a node
        its parent lists is reachable from the root; a split keeps the lower part's object (and so the
        position it ends at)."""
        if node is self.root:
            return True
        parent = node.parent
        return bool(node.pages) and parent is not None and parent.children.get(self._child_key(node.key, 0)) is node

    def _count_pages(self, node: TreeNode, n: int) -> None:
        """Counters for ``n`` L1 pages that ``node`` gained (negative: lost)."""
        if node.lock_ref > 0:
            self.protected_pages += n
        else:
            self.evictable_pages += n

    # Hooks of the hierarchical cache (no-ops here).
    def _hit(self, node: TreeNode) -> None:
        """``node`` was matched by a request."""

    def _inserted(self, node: TreeNode) -> None:
        """``node`` is a new leaf holding freshly computed KV."""

    def inc_lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages from unlocked leaves, LRU first (fewer if not possible)."""
        leaves = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None  # type narrowing only: a leaf in the tree has a parent
            del parent.children[self._child_key(node.key, 0)]
            self.evictable_pages -= len(node.pages)
            freed += len(node.pages)
            self._free_pages(node.pages)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def flush(self) -> int:
        """Evict everything evictable (used by /flush_cache)."""
        return self.evict(self.evictable_pages)

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
