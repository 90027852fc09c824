"""Sliding-window KV as a ledger state: the pages of tokens that left every layer's window.

A model whose every layer attends within a window of W tokens (Mistral's ``sliding_window``, Phi-3,
Mixtral, Qwen2/3 sliding from layer 0) reads a query at position q against keys (q - W, q] only, so
once the next token a request computes is at position q, the KV of tokens before q - W + 1 is never
read again. Its pages are released while the request runs, in runs of ``run_pages``:

    req.pages[0, num_tree_pages)                      borrowed (tree or session), kept: not the
                                                      request's to give back
    [num_tree_pages, num_tree_pages + num_out_pages)  OUT OF WINDOW: given back; the entries are
                                                      ``OUT_OF_WINDOW`` and so is the page table's
                                                      (a read of one fails loudly)
    [num_tree_pages + num_out_pages, len(pages))      PRIVATE, as for full attention

Where they go: with the prefix cache on (and a request that is no session turn), into the radix tree
as a prefix of the request's tokens, CACHED and evictable: the pages are no longer the request's, any
allocation may evict them, and until then a later request with the same prefix hits them. The tree
never has a hole: a run is added below ``req.window_node`` (where the request's released prefix ends
in the tree) only while that node still holds its path (``RadixCache.holds_path``: not evicted,
not demoted to L2); once it does not, this and later runs are freed, and at the end the request's
remaining KV is not cached either (it would hang below a path the tree no longer has). Without the
prefix cache, and for session turns (whose KV goes to the session), the pages are freed.

Which models: only those whose every layer has a window. In Gemma 2/3 the full-attention layers read
every position, and all layers share one page per token, so nothing is out of window for them
(a separate pool for the sliding layers' KV would be needed; docs/architecture.md has the sums).
"""

from __future__ import annotations

from ..errors import OwnershipError

OUT_OF_WINDOW = -1
"""The entry of a released page in ``req.pages`` / ``Session.pages`` (and the page table's location
for its tokens): never a page id, never freed or cached, never read by the attention."""

RUN_TOKENS = 64
"""Out-of-window pages are released in runs of at least min(W, RUN_TOKENS) tokens: each run is one
radix node and one insert, not one per decoded token (pages of 1 token are the default)."""


def release_window(windows: list[int | None]) -> int | None:
    """The window past which KV may be released: that of the widest layer when every layer has one;
    None when some layer attends to every position (or there are no windows)."""
    if windows and all(w is not None for w in windows):
        return max(w for w in windows if w is not None)
    return None


def is_out(page: int) -> bool:
    return page < 0


def real_pages(pages: list[int]) -> list[int]:
    """``pages`` without out-of-window entries."""
    return [p for p in pages if p >= 0]


class WindowKV:
    """The memory side of sliding windows, under ``KVManager`` (which calls it; nothing else does)."""

    def __init__(self, kv_manager, window: int):
        self.kvm = kv_manager
        self.window = window
        ps = kv_manager.page_size
        self.run_pages = max(1, -(-min(window, RUN_TOKENS) // ps))
        self.released_pages = 0  # pages given back out of window, ever
        self.cached_pages = 0  # ... of them, those that went into the radix tree

    def first_needed_page(self, first_query: int) -> int:
        """The first page a query at ``first_query`` or later reads (every page before it is out of window)."""
        return max(0, first_query - self.window + 1) // self.kvm.page_size

    def releasable(self, req, first_query: int) -> tuple[int, int]:
        """``[start, end)`` of ``req.pages``: the private pages wholly outside the window of a query at
        ``first_query`` (the next position the request computes, or the earliest one a launched step
        still computes) that are still held."""
        start = req.num_tree_pages + req.num_out_pages
        return start, max(start, self.first_needed_page(first_query))

    def slide(self, req, first_query: int) -> int:
        """Give back ``req``'s pages outside the window of a query at ``first_query`` (at least a run of
        them, else nothing yet); returns how many. Their entries become ``OUT_OF_WINDOW``, in the page
        table too. Only at a safe point, before the step is built."""
        kvm, ps = self.kvm, self.kvm.page_size
        if req.session is not None:
            # The next turn borrows whole pages only (its first query at a page boundary at or before
            # this turn's end): keep what a query there reads, or that turn would recompute everything.
            first_query -= first_query % ps
        start, end = self.releasable(req, first_query)
        n = end - start
        if n < self.run_pages:
            return 0
        if end * ps > req.kv_len:
            raise OwnershipError(
                f"req {req.rid}: pages up to {end} would go out of window past its computed KV ({req.kv_len} tokens)"
            )
        pages = req.pages[start:end]
        owner = f"req {req.rid} (out of window)"
        tree, node = kvm.tree, req.window_node
        if tree.enabled and req.session is None and req.kv_trusted and node is not None and tree.holds_path(node):
            present, req.window_node = tree.insert_below(node, self._key(req, start * ps, end * ps), pages)
            dup = present // ps  # someone else cached the same tokens meanwhile: ours are duplicates
            kvm.free(pages[:dup], owner)
            kvm.pages.set_owner(pages[dup:], "radix")
            self.cached_pages += n - dup
        else:
            kvm.free(pages, owner)
            req.window_node = None
        req.pages[start:end] = [OUT_OF_WINDOW] * n
        req.num_out_pages += n
        kvm._map(req, start, [OUT_OF_WINDOW] * n)
        self.released_pages += n
        return n

    def commit(self, req, kv_len: int, owner: str) -> None:
        """The one release path (``KVManager._return_pages``) for a request with out-of-window pages
        whose KV is committed: its first ``kv_len`` tokens' page-aligned KV after the released prefix
        goes into the tree below ``req.window_node`` (duplicates, the partial page and over-allocation
        freed), or, when the released prefix is no longer all in the tree, every private page is freed."""
        kvm, ps = self.kvm, self.kvm.page_size
        first = req.num_tree_pages + req.num_out_pages
        node = req.window_node
        if node is None or not kvm.tree.enabled or not kvm.tree.holds_path(node):
            kvm.free(req.pages[first:], owner)
            return
        aligned = max(kv_len // ps, first)
        kvm.free(req.pages[aligned:], owner)  # partial page and over-allocation
        present, _ = kvm.tree.insert_below(node, self._key(req, first * ps, aligned * ps), req.pages[first:aligned])
        dup = first + present // ps
        kvm.free(req.pages[first:dup], owner)
        kvm.pages.set_owner(req.pages[dup:aligned], "radix")

    def borrowable(self, pages: list[int], n: int) -> int:
        """How many of a session's leading ``pages`` a turn may borrow, of the ``n`` it would: all of
        them when every page the turn's first query reads (those of the window before position
        ``n * page_size``) holds KV, else none (the turn recomputes its history)."""
        lo = self.first_needed_page(n * self.kvm.page_size)
        return n if not any(is_out(p) for p in pages[lo:n]) else 0

    def _key(self, req, a: int, b: int) -> list[int]:
        """Tokens ``[a, b)`` of ``req``'s prefix-cache key (only its first page is salted)."""
        ps = self.kvm.page_size
        if a >= ps:
            return req.tokens(a, b)
        return self.kvm.cache_key(req)[a:b]

    def figures(self, holdings) -> dict:
        """``memory.window``: the window, pages out of window now (live requests' and sessions'), and
        the pages released so far (and of them, cached)."""
        ps = self.kvm.page_size
        out = sum(h.out_of_window for h in holdings)
        return {
            "window": self.window,
            "run_tokens": self.run_pages * ps,
            "out_of_window_tokens": out * ps,
            "released_tokens_total": self.released_pages * ps,
            "released_to_cache_tokens_total": self.cached_pages * ps,
        }
