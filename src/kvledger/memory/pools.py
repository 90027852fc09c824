"""The two pools: KV pages (plus the tensors they index) and request slots (rows of the page table).

Pools only hand out and take back ids; *who* owns an id is the ledger's business. Each id remembers
its last owner so that an audit can name it.
"""

from __future__ import annotations

import torch


class KVBuffer:
    """K and V tensors of all layers: ``k[layer]`` is ``[kv_heads, num_pages * page_size, head_dim]``.

    Cache location ``page * page_size + offset`` holds token ``offset`` of page ``page``. Heads lead so
    that a gather of a batch's locations comes out as ``[kv_heads, tokens, head_dim]``, the layout
    batched attention matmuls want without another copy.
    """

    def __init__(self, num_layers: int, num_tokens: int, kv_heads: int, head_dim: int, dtype, device="cpu"):
        self.k = torch.zeros(num_layers, kv_heads, num_tokens, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_layers, kv_heads, num_tokens, head_dim, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PagePool:
    """Free list of KV pages. ``alloc`` never hands out a page twice until it is freed."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page ids first, which keeps tests' reports readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray([1]) * num_pages
        self.last_owner: list[str] = ["never allocated"] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int, owner: str) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        for p in pages:
            self._is_free[p] = 0
            self.last_owner[p] = owner
        return pages

    def free(self, pages: list[int], by: str) -> list[int]:
        """Return pages to the free list; returns the pages that were already free (double frees),
        which are not added twice. The caller reports them."""
        doubles = []
        for p in pages:
            if self._is_free[p]:
                doubles.append(p)
                continue
            self._is_free[p] = 1
            self._free.append(p)
            self.last_owner[p] = f"freed by {by}"
        return doubles

    def set_owner(self, pages: list[int], owner: str) -> None:
        for p in pages:
            self.last_owner[p] = owner

    def free_list(self) -> list[int]:
        return list(self._free)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])


class ReqSlotPool:
    """Request slots: a live request's row of the page table (which the executor holds, see
    ``engine/page_table.py``). A slot is free, used by one live request, or nothing else."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray([1]) * num_slots
        self.last_owner: list[str] = ["never allocated"] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, owner: str) -> int | None:
        if not self._free:
            return None
        s = self._free.pop()
        self._is_free[s] = 0
        self.last_owner[s] = owner
        return s

    def free(self, slot: int, by: str) -> bool:
        """Returns False (and changes nothing) on a double free."""
        if self._is_free[slot]:
            return False
        self._is_free[slot] = 1
        self._free.append(slot)
        self.last_owner[slot] = f"freed by {by}"
        return True

    def free_list(self) -> list[int]:
        return list(self._free)
