"""The request->token table on the executor's side: row ``slot``, column ``i`` is the cache location
(``page * page_size + offset``) of token ``i`` of the request in that slot. The scheduler's
``KVManager`` decides the pages; it sends the changes as ``PageWrite``s in each ``SchedulerOutput``
(so a tensor-parallel worker keeps the same table from the same messages).

A page given back out of window (sliding windows, ``memory/window.py``) comes as ``OUT_OF_WINDOW``:
its tokens' locations become -1, which the attention never reads (its window starts later) and any
gather of would fail on, rather than read another request's KV."""

from __future__ import annotations

import torch

from ..memory import PageWrite


class PageTable:
    def __init__(self, num_slots: int, max_context: int, page_size: int, device="cpu"):
        self.page_size = page_size
        self.num_slots = num_slots
        row = -(-max_context // page_size) * page_size  # whole pages for the longest sequence
        self.req_to_token = torch.zeros(num_slots, row, dtype=torch.int64, device=device)
        self._offsets = torch.arange(page_size)
        self.pad_row: int | None = None

    def add_pad_row(self, page: int) -> int:
        """One more row, past the request slots, every column of which is a location of ``page``
        (reserved in the books: ``KVManager.reserve``): the padding rows of a captured decode step
        read and write there (``engine/graph_runner.py``). Before the first step only (the table is
        reallocated). Returns its index."""
        if self.pad_row is not None:
            raise RuntimeError("the page table has its padding row already")
        t = self.req_to_token
        pad = torch.full((1, t.shape[1]), page * self.page_size, dtype=t.dtype, device=t.device)
        self.req_to_token = torch.cat([t, pad])
        self.pad_row = self.num_slots
        return self.pad_row

    def apply(self, writes: list[PageWrite]) -> None:
        ps = self.page_size
        for w in writes:
            # Built on the host; the assignment copies them to the table's device.
            p = torch.tensor(w.pages, dtype=torch.int64).unsqueeze(1)
            cols = p * ps + self._offsets
            if min(w.pages) < 0:  # out-of-window entries: location -1
                cols = torch.where(p < 0, -1, cols)
            cols = cols.flatten()
            begin = w.start_page * ps
            self.req_to_token[w.slot, begin : begin + cols.numel()] = cols
