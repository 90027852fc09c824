"""The layout of a running request's page list, and who owns each region of it.

Who owns a running request's pages (``req.pages``)::

    [0, num_tree_pages)                borrowed: the radix tree's (locked) or the turn's session's
    [num_tree_pages, + num_out_pages)  out of window (sliding-window models, ``memory/window.py``):
                                       given back; entries ``OUT_OF_WINDOW``
    [.., ceil(kv_len/ps))              PRIVATE: computed KV not yet cached (the partial last page too)
    [ceil(kv_len/ps), len(pages))      PRIVATE: over-allocation (lookahead for the next tokens or
                                       drafts, KV arriving from a connector); given back by
                                       ``truncate`` or trimmed by ``release``

``request_holding`` reads that layout into the ledger's ``Holding``; ``forget_pages`` empties it once
``KVManager`` has given every page back. Page-table changes are queued as ``PageWrite``s for the
executor, which owns the request->token table.
"""

from __future__ import annotations

from dataclasses import dataclass

from .audit import Holding


@dataclass(slots=True)
class PageWrite:
    """Row ``slot`` of the page table gets ``pages`` from page index ``start_page`` on."""

    slot: int
    start_page: int
    pages: list[int]


def request_holding(req) -> Holding:
    """What ``req`` holds, as the ledger's audit counts it: its private pages, its borrowed prefix
    and its slot."""
    label = req.state.ledger_label
    return Holding(
        owner=f"req {req.rid}" + (f" [{label}]" if label else ""),
        kind="request",
        own_pages=req.pages[req.num_tree_pages + req.num_out_pages :],
        borrowed_pages=req.pages[: req.num_tree_pages],
        slot=req.slot,
        borrowed_from=None if req.session is None else req.session.owner,
        out_of_window=req.num_out_pages,
        entries=len(req.pages),
        kv_len=req.kv_len,
    )


def forget_pages(req) -> None:
    """``req`` holds no page entries any more (each one given back or accounted for already)."""
    req.pages = []
    req.num_tree_pages = 0
    req.prefix_node = None
    req.num_out_pages = 0
    req.window_node = None
