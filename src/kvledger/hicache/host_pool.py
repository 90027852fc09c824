"""The L2 tier: host-memory KV pages, page-first, as ids (``HostPool``, rank 0, with the books) and
as data (``HostKV``, one per tensor-parallel rank: that rank's heads of every L2 page).

Page-first layout: ``data[p]`` is one contiguous ``[2, layers, kv_heads, page_size, head_dim]`` block,
so a page is one memcpy to or from a file (L3) and one block for a transfer engine. L1 (the engine's
``KVBuffer``) is ``[layers, kv_heads, tokens, head_dim]`` per K and V; the copies below convert.

The pool only hands out ids and remembers each id's last owner; who owns an L2 page (a radix node, a
prefetch in flight, an idle session) is in the books (``hicache/books.py``). ``pins`` counts the loads
reading a page this step and ``storing`` marks a page being written to L3 (on every rank): a pinned
page is never evicted or freed. Under tensor parallelism an L2 page id means the same page on every
rank, as an L1 page id does: rank 0 decides, every rank's ``HostKV`` holds its heads of it.
"""

from __future__ import annotations

import torch

from ..memory.pools import KVBuffer, PagePool


class HostPool(PagePool):
    """L2 page ids, pins and store flags (rank 0: the policy's and the books' view)."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages, page_size)  # ids, free list and last owners as L1's pool
        self.pins = [0] * num_pages
        self.storing = bytearray(num_pages)

    def pinned(self, pages: list[int]) -> bool:
        return any(self.pins[p] or self.storing[p] for p in pages)


class HostKV:
    """One rank's heads of every L2 page, and the copies between them and that rank's L1."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        # empty, not zeros: the OS maps host pages in as they are first written, so an unused L2
        # costs no resident memory.
        self.data = torch.empty(
            num_pages, 2, num_layers, kv_heads, page_size, head_dim, dtype=dtype, pin_memory=pin_memory
        )

    @staticmethod
    def page_bytes_of(page_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * kv_heads * page_size * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def page_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def _locs(self, l1_pages: list[int], device) -> torch.Tensor:
        ps = self.page_size
        base = torch.tensor(l1_pages, dtype=torch.long, device=device) * ps
        return (base[:, None] + torch.arange(ps, device=device)).reshape(-1)

    def save(self, kv: KVBuffer, l1_pages: list[int], host_pages: list[int]) -> None:
        """L1 -> L2, all layers: ``host_pages[i]`` gets the tokens of ``l1_pages[i]``."""
        if not l1_pages:
            return
        locs = self._locs(l1_pages, kv.k.device)
        n, ps = len(l1_pages), self.page_size
        for j, t in enumerate((kv.k, kv.v)):
            block = t[:, :, locs, :]  # [layers, heads, n * ps, dim]
            layers, heads, _, dim = block.shape
            block = block.reshape(layers, heads, n, ps, dim).permute(2, 0, 1, 3, 4)
            self.data[host_pages, j] = block.to(self.data.device, non_blocking=True)

    def load_layer(self, kv: KVBuffer, layer: int, host_pages: list[int], l1_pages: list[int]) -> None:
        """L2 -> L1 for one layer (called just before that layer's attention)."""
        if not l1_pages:
            return
        locs = self._locs(l1_pages, kv.k.device)
        src = self.data[host_pages, :, layer]  # [n, 2, heads, ps, dim]
        n, _, heads, ps, dim = src.shape
        src = src.permute(1, 2, 0, 3, 4).reshape(2, heads, n * ps, dim).to(kv.k.device, non_blocking=True)
        kv.k[layer][:, locs, :] = src[0]
        kv.v[layer][:, locs, :] = src[1]

    def load(self, kv: KVBuffer, host_pages: list[int], l1_pages: list[int]) -> None:
        """L2 -> L1, all layers."""
        for layer in range(kv.k.shape[0]):
            self.load_layer(kv, layer, host_pages, l1_pages)

    def page_view(self, p: int) -> torch.Tensor:
        """Page ``p`` as raw bytes (a view: the L3 writer reads it, the L3 reader fills it)."""
        return self.data[p].view(torch.uint8).reshape(-1)
