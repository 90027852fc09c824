"""The order of the waiting queue: request priorities, then SGLang's ``--schedule-policy``.

* ``fcfs``: arrival order (``Req.arrival_seq``; a retracted request keeps its place).
* ``lpm``: longest prefix-cache match first (the radix tree, read without touching it: ``peek``).
  As SGLang's: a request that matches little of the cache (<= 32 tokens) but shares >= 32 tokens
  with one already ahead of it in the queue is put last for this step, so that one computes the
  shared prefix and the rest find it cached; past 128 waiting requests the matches cost too much and
  the order is fcfs.
* ``dfs-weight``: a depth-first walk of the radix tree, heavier subtrees first (weight: the waiting
  requests whose match ends in the subtree); each node's own requests after its subtrees'.

With ``--enable-priority-scheduling`` requests are grouped by priority (most important first) and the
policy orders each group; without it the policy alone decides (and fcfs leaves the queue as it is).
SGLang's convention: a larger ``priority`` is more important unless ``--schedule-low-priority-values-
first``; a request without one is the least important. ``priority_rank`` turns both into one number,
smaller = more important, which the preemption rule (``preemption.py``) compares too.
"""

from __future__ import annotations

import sys
from collections import defaultdict, deque
from collections.abc import Callable

from ..config import SchedulerSettings
from ..memory.radix import RadixCache, TreeNode
from .request import Req

LPM_QUEUE_LIMIT = 128  # SGLang: a longer queue is served fcfs under lpm (one tree walk per request)
IN_QUEUE_CHECK_TOKENS = 32  # SGLang's in-batch prefix thresholds: a cache match at most this short ...
IN_QUEUE_SHARED_TOKENS = 32  # ... and this much shared with a request ahead puts a request last


def priority_rank(priority: int | None, low_values_first: bool) -> int:
    """``priority`` as a rank, smaller = more important. No priority: SGLang gives the request the
    least important value there is (``sys.maxsize`` or ``-sys.maxsize - 1``), so any request with a
    priority may preempt it and it preempts nothing."""
    if priority is None:
        priority = sys.maxsize if low_values_first else -sys.maxsize - 1
    return priority if low_values_first else -priority


def may_preempt(arrival: Req, running: Req, threshold: int) -> bool:
    """SGLang's rule: ``arrival`` preempts ``running`` when its priority is higher by more than the
    threshold."""
    return running.priority_rank - arrival.priority_rank > threshold


class QueueOrder:
    """Sorts the scheduler's waiting queue once per step (``BatchPolicy.schedule``)."""

    def __init__(self, settings: SchedulerSettings, tree: RadixCache, cache_key: Callable[[Req], list[int]]):
        self.settings = settings
        self.tree = tree
        self.cache_key = cache_key  # a request's tokens as the prefix cache keys them (salted)

    @property
    def active(self) -> bool:
        s = self.settings
        return s.enable_priority_scheduling or s.cache_aware_policy

    def rank(self, req: Req) -> int:
        s = self.settings
        if not s.enable_priority_scheduling:
            return 0
        return priority_rank(req.params.priority, s.schedule_low_priority_values_first)

    def sort(self, waiting: deque[Req]) -> None:
        """Reorder ``waiting`` in place (nothing changes under plain fcfs)."""
        if not self.active or len(waiting) < 2:
            return
        groups: dict[int, list[Req]] = defaultdict(list)
        for r in sorted(waiting, key=lambda r: r.arrival_seq):
            groups[r.priority_rank].append(r)
        policy = self.settings.schedule_policy
        if policy == "lpm" and len(waiting) > LPM_QUEUE_LIMIT:
            policy = "fcfs"
        order = {"fcfs": list, "lpm": self._lpm, "dfs-weight": self._dfs_weight}[policy]
        out = [r for rank in sorted(groups) for r in order(groups[rank])]
        waiting.clear()
        waiting.extend(out)

    # -- the cache-aware policies ----------------------------------------------------------------------
    def _match(self, req: Req) -> tuple[int, TreeNode]:
        """What ``req`` would find cached now: tokens and the deepest node (a session turn borrows its
        session's KV instead: that length, at the root)."""
        if req.session is not None:
            return min(req.session.kv_len, req.reuse_limit), self.tree.root
        return self.tree.peek(self.cache_key(req)[: req.reuse_limit])

    def _lpm(self, reqs: list[Req]) -> list[Req]:
        matched = {id(r): self._match(r)[0] for r in reqs}
        # Requests ahead in the queue, as a throwaway tree of page size 1 (its "pages" are dummies).
        ahead = RadixCache(1, lambda pages: None)
        last: set[int] = set()
        for r in reqs:
            if matched[id(r)] > IN_QUEUE_CHECK_TOKENS:
                continue
            key = self.cache_key(r)
            if ahead.peek(key)[0] >= IN_QUEUE_SHARED_TOKENS:
                last.add(id(r))
            else:
                ahead.insert(key, list(range(len(key))))
        return sorted(reqs, key=lambda r: (id(r) in last, -matched[id(r)]))  # stable: arrival breaks ties

    def _dfs_weight(self, reqs: list[Req]) -> list[Req]:
        at: dict[TreeNode, list[Req]] = defaultdict(list)
        weight: dict[TreeNode, int] = defaultdict(int)
        for r in reqs:
            node = self._match(r)[1]
            at[node].append(r)
            n: TreeNode | None = node
            while n is not None:
                weight[n] += 1
                n = n.parent
        out: list[Req] = []
        # Iterative post-order walk of the nodes with waiting requests below them: children by weight,
        # heaviest first, then the node's own requests.
        stack: list[tuple[TreeNode, bool]] = [(self.tree.root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(at.get(node, ()))
                continue
            stack.append((node, True))
            kids = sorted((c for c in node.children.values() if weight.get(c)), key=lambda c: -weight[c])
            stack.extend((c, False) for c in reversed(kids))
        return out
