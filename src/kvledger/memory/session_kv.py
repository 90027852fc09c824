"""The memory side of streaming sessions: a session's SESSION pages, what a turn borrows, and what
a turn's release commits into its session. Lifecycle (open, close, expiry, attach) is
``scheduler/sessions.py``; every page movement is here, under ``KVManager``.

A session holds the KV of ``tokens[:kv_len]`` in its pages. A turn borrows the session's *full*
pages (never the partial last one, which it would write into). When the turn completes (stop or
length), its KV becomes the session's: the session's superseded pages (the old partial page, a tail
orphaned by a shorter ``offset``) and the turn's over-allocation are freed first. A turn that ends by
abort leaves the session exactly as it was.

Sliding-window models (``memory/window.py``): a turn gives back its own out-of-window pages (freed:
they are not session pages), and a completed turn's session keeps only the pages its next turn can
read (the window before the last whole page's end), so the session's page list has ``OUT_OF_WINDOW``
entries; a turn borrows the session's pages only when every page its first query reads holds KV
(else it recomputes the history: a rewind into the released part), and an idle session with such
entries is dropped rather than demoted to L2.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import OwnershipError
from .audit import Holding
from .window import OUT_OF_WINDOW, real_pages


@dataclass(eq=False)
class Session:
    id: str
    timeout_s: float | None
    tokens: list[int] = field(default_factory=list)  # the conversation so far
    pages: list[int] = field(default_factory=list)  # SESSION pages: KV of tokens[:kv_len]
    num_out: int = 0  # entries of ``pages`` given back out of window (sliding windows)
    host: list[int] = field(default_factory=list)  # ... or, demoted while idle, its L2 pages
    kv_len: int = 0
    busy_rid: str | None = None
    closing: bool = False  # close requested while a turn runs (close_on_finish)
    last_used: float = field(default_factory=time.monotonic)
    turns: int = 0
    # The images among ``tokens`` (``multimodal.ImageItem``s at their positions there): the session's
    # own, committed with the turn that sent them, so that a turn that recomputes the history (its KV
    # dropped for room, a rewind) encodes them again; gone with the session.
    images: tuple = ()

    @property
    def image_bytes(self) -> int:
        return sum(im.pixel_values.nbytes for im in self.images)

    @property
    def owner(self) -> str:
        return f"session {self.id}"


class SessionKV:
    def __init__(self, kv_manager):
        self.kv_manager = kv_manager
        self.by_id: dict[str, Session] = {}
        self.evictions = 0  # idle sessions whose KV was dropped (or demoted to L2) for room

    def idle_pages(self) -> int:
        return sum(len(s.pages) - s.num_out for s in self.by_id.values() if s.busy_rid is None)

    def image_bytes(self) -> int:
        """The pixel bytes the open sessions keep for their histories' images."""
        return sum(s.image_bytes for s in self.by_id.values())

    @staticmethod
    def held(s: Session) -> list[int]:
        """The pages ``s`` holds (its entries less the out-of-window ones)."""
        return real_pages(s.pages) if s.num_out else s.pages

    def holdings(self):
        for s in self.by_id.values():
            yield Holding(
                owner=s.owner, kind="session", own_pages=self.held(s), host_pages=s.host, kv_tokens=s.kv_len,
                out_of_window=s.num_out,
            )

    def borrow(self, req) -> list[int]:
        """The session pages a turn reads; at least one token is always computed. A session
        demoted to L2 while idle is loaded back first."""
        s = req.session
        if s.host:
            self.kv_manager.tiers.promote_session(s)
        n = min(s.kv_len, req.session_offset, req.reuse_limit) // self.kv_manager.page_size
        if s.num_out and self.kv_manager.window is not None:
            n = self.kv_manager.window.borrowable(s.pages, n)
        return s.pages[:n]

    def free_pages(self, s: Session) -> None:
        if s.busy_rid is not None:
            raise OwnershipError(f"{s.owner}: its pages are freed while turn {s.busy_rid} borrows them")
        self._free(s)

    def drop_all_kv(self) -> int:
        """Free every session's KV, keeping its tokens (the weights changed: the KV was computed by
        the old ones), so that each session's next turn recomputes its whole history. The caller
        guarantees that no turn holds a slot: a turn waiting in the queue (a retracted one) borrows
        nothing until it is admitted, and then finds ``kv_len`` 0. Returns the tokens dropped."""
        dropped = 0
        for s in self.by_id.values():
            dropped += s.kv_len
            self._free(s)
        return dropped

    def _free(self, s: Session) -> None:
        self.kv_manager.free(self.held(s), s.owner)
        if s.host:
            self.kv_manager.tiers.host_free(s.host, s.owner)
        s.pages, s.host = [], []
        s.num_out = 0
        s.kv_len = 0

    def release(self, s: Session) -> None:
        """Give back everything a session holds and forget it (close, expiry, close_on_finish)."""
        self.free_pages(s)
        self.by_id.pop(s.id, None)

    def evict_idle(self, n: int) -> None:
        """Take idle sessions' KV out of L1, least recently used first, so that sessions never
        starve normal requests: demoted to L2 with the hierarchical cache (loaded back on the next
        turn), else dropped (the next turn recomputes from the session's tokens)."""
        idle = sorted(
            (s for s in self.by_id.values() if s.busy_rid is None and s.pages), key=lambda s: s.last_used
        )
        tiers = self.kv_manager.tiers
        for s in idle:
            if n <= 0:
                return
            n -= len(s.pages) - s.num_out
            # (KV with out-of-window entries is not demoted: L2 holds a session's pages as one run.)
            if tiers is None or s.num_out or not tiers.demote_session(s):
                self.free_pages(s)
            self.evictions += 1

    def _drop_out_of_window(self, s: Session, kv_len: int) -> None:
        """Sliding windows: the session gives back the pages its next turn cannot read (those before
        the window of the last whole page's end, where that turn's first query is), earlier turns'
        included, and counts its out-of-window entries."""
        window = self.kv_manager.window
        if window is None:
            return  # (no entry is ever out of window: num_out stays 0)
        ps = self.kv_manager.page_size
        lo = min(window.first_needed_page(kv_len - kv_len % ps), len(s.pages))
        gone = real_pages(s.pages[:lo])
        self.kv_manager.free(gone, f"{s.owner} (out of window)")
        window.released_pages += len(gone)
        s.pages[:lo] = [OUT_OF_WINDOW] * lo
        s.num_out = sum(1 for p in s.pages if p < 0)

    def release_turn(self, req, commit: bool, final: bool) -> None:
        """A turn's pages, in ``KVManager.release`` (which then frees its slot): a completed turn
        (``commit`` and ``final``) of a session not closing hands its KV to the session; any other
        gives back its own pages, leaving the session as it was."""
        s = req.session
        owner = f"req {req.rid}"
        borrowed = req.num_tree_pages
        first = borrowed + req.num_out_pages  # (its own out-of-window pages are gone already)
        if commit and final and not s.closing:
            keep = -(-req.kv_len // self.kv_manager.page_size)
            # superseded by the turn's pages
            self.kv_manager.free(real_pages(s.pages[borrowed:]), s.owner)
            self.kv_manager.free(req.pages[keep:], owner)  # over-allocation: trimmed before the handover
            self.kv_manager.pages.set_owner(req.pages[first:keep], s.owner)
            s.pages = req.pages[:keep]
            self._drop_out_of_window(s, req.kv_len)
            s.kv_len = req.kv_len
            s.tokens = req.fill_ids
            s.images = req.mm.images if req.mm is not None else ()  # (every image is in the prompt)
            s.turns += 1
        else:
            self.kv_manager.free(req.pages[first:], owner)

    def end_turn(self, req) -> None:
        """The last step of a turn's release: its session is idle again, and released if a close
        waited for the turn (close_on_finish)."""
        s = req.session
        s.busy_rid = None
        s.last_used = time.monotonic()
        req.session = None
        if s.closing:
            self.release(s)
