"""L3 prefetches (rank 0, with the tiers): while a request waits in the queue, the files of its prompt's
pages that no tier holds are read into L2 pages that the prefetch owns, and go into the tree when every
rank has read them.

Which pages exist is asked of rank 0's files; a rank that lacks one reads fewer, and only the pages
every rank read, from the first, are kept (``Prefetch.good``). A request waits for its prefetch until
the deadline (``--hicache-prefetch-timeout``), then goes on without it; the read still lands in the
tree for later requests. A request that ends first cancels its read; the pages are freed when the read
reports. The reads are ops (``ops.py``) that ``Tiers.do`` applies on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..memory.cache_key import cache_key
from .ops import Cancel, Read


@dataclass(eq=False)
class Prefetch:
    """An L3 read for a queued request: the prompt's pages ``[start_page, ...)`` (``tokens`` is the
    prompt prefix they complete) into ``host_pages``, owned by the prefetch until every rank has
    reported; ``good``: the pages every rank read, from the first."""

    id: int
    rid: str
    tokens: list[int]
    start_page: int
    host_pages: list[int]
    deadline: float
    cancelled: bool = False  # the request ended: stop reading (the pages are freed when it reports)
    good: int = 0
    reports: list[int] = field(default_factory=list)  # pages read, one entry per rank reported

    @property
    def owner(self) -> str:
        return f"prefetch for req {self.rid}" + (" [cancelled]" if self.cancelled else " [loading from L3]")


class Prefetcher:
    def __init__(self, tiers, threshold: int, timeout_s: float):
        self.tiers = tiers  # the Tiers: L2 pages, the tree, the files, the ops, the stats
        self.threshold = threshold  # tokens: shorter L3 hits are not prefetched
        self.timeout_s = timeout_s
        self.waited: dict[str, Prefetch] = {}  # rid -> the prefetch its request waits for
        self.reads: dict[int, Prefetch] = {}  # op id -> every prefetch in flight (waited for or not)

    def start(self, req) -> None:
        """Read the files of the prompt's pages that no tier holds, while the request waits in the
        queue: they go to L2 pages owned by the prefetch, and into the tree when every rank has read
        them. Which pages exist is asked of rank 0's files; a rank that lacks one reads fewer."""
        t = self.tiers
        if t.storage is None or req.session is not None:
            return
        ps = t.page_size
        tokens = cache_key(req.fill_ids, req.params.cache_salt, ps, req.lora_key, req.mm and req.mm.images)[: req.reuse_limit]
        npages = len(tokens) // ps
        have = t.tree.covered(tokens) // ps
        if (npages - have) * ps < self.threshold:
            return
        keys = t.hasher.chain(tokens, npages)
        k = t.storage.batch_exists(keys[have:])
        if k * ps < self.threshold:
            return
        host = t.host_alloc(k, f"prefetch for req {req.rid}")
        if host is None:
            t.stats.prefetch_no_room += 1
            return
        op = Prefetch(
            next(t.op_ids),
            req.rid,
            tokens[: (have + k) * ps],
            have,
            host,
            time.monotonic() + self.timeout_s,
        )
        self.waited[req.rid] = self.reads[op.id] = op
        t.stats.prefetches += 1
        t.do(Read(op.id, op.tokens, op.start_page, list(host)))

    def pending(self, req) -> bool:
        """Whether ``req`` should wait for its prefetch (in flight and within its deadline)."""
        op = self.waited.get(req.rid)
        if op is None:
            return False
        if time.monotonic() < op.deadline:
            return True
        # Late: the request goes on without it; the read still lands in the tree for later requests.
        del self.waited[req.rid]
        self.tiers.stats.prefetches_late += 1
        return False

    def cancel(self, rid: str) -> None:
        op = self.waited.pop(rid, None)
        if op is not None:
            op.cancelled = True
            self.tiers.stats.prefetches_cancelled += 1
            self.tiers.do(Cancel(op.id))

    def done(self, op: Prefetch) -> None:
        """Every rank has reported ``op``: the pages all of them read go into the tree, the rest back."""
        t = self.tiers
        del self.reads[op.id]
        if self.waited.get(op.rid) is op:
            del self.waited[op.rid]
        ps = t.page_size
        op.good = min(op.reports)  # all ranks or none, page by page
        t.stats.prefetch_pages_short += max(op.reports) - op.good
        good = op.host_pages[: op.good]
        unused = op.host_pages[op.good :]
        if good:
            # Read pages are good KV whether or not their request is still here: into the tree.
            end = (op.start_page + op.good) * ps
            back = t.tree.insert_host(op.tokens[:end], good, op.start_page * ps)
            t.stats.l3_hit_tokens += (len(good) - len(back)) * ps
            unused = back + unused
        t.host_free(unused, op.owner)

    def ops(self) -> list[Prefetch]:
        """Every prefetch in flight (the books: their L2 pages are theirs)."""
        return list(self.reads.values())
