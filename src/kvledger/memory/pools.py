"""The two pools: KV pages (plus the tensors they index) and request slots (rows of the page table).

Pools only hand out and take back ids; *who* owns an id is the ledger's business. Each id remembers
its last owner so that an audit can name it. An id is free, handed out, or QUARANTINED: one a
production-mode audit found with no owner on its books, held aside (never handed out) until it is
proven unowned (``Ledger``) or the owner the audit missed gives it back.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading

import torch

from ..errors import OwnershipError


class KVBuffer:
    """K and V tensors of all layers: ``k[layer]`` is ``[kv_heads, num_pages * page_size, head_dim]``.

    Cache location ``page * page_size + offset`` holds token ``offset`` of page ``page``. Heads lead so
    that a gather of a batch's locations comes out as ``[kv_heads, tokens, head_dim]``, the layout
    batched attention matmuls want without another copy.
    """

    def __init__(self, num_layers: int, num_tokens: int, kv_heads: int, head_dim: int, dtype, device="cpu"):
        shape = (num_layers, kv_heads, num_tokens, head_dim)
        if torch.device(device).type == "cpu":
            self.k, self.v = zeroed_host_tensor(shape, dtype, huge=False), zeroed_host_tensor(shape, dtype, huge=False)
            # The head of every (layer, head) plane (one 2 MiB huge page: 16,384 tokens of SmolLM2 in
            # bf16, 32,768 in float8) is advised for huge pages and mapped now: a fresh pool hands out
            # low page ids first, and left to the first requests those huge-page faults cost them
            # 0.7-1.4 s (zeroing and compaction, measured). The rest of the pool maps as it fills, in
            # 4 KB pages: a huge page there is compacted and zeroed inside the step that first
            # writes it, 0.3-1 GB/s on these VMs (32 streams offline, ten waves of 128 + 128 tokens:
            # 977 -> 710-818 tok/s from the third wave on, where 4 KB pages keep 845-940).
            # The mapping runs on a thread of its own (madvise releases the GIL): zeroing a huge page
            # per plane (352 MiB for the 1.2B Q4_K_M's 22 layers x 4 heads x K/V) took 0.5-1 s of
            # a warm start, which now goes on while the engine builds the rest and answers Ready.
            # A request that comes first faults its own pages, as it would without the prefault.
            rows = min(num_tokens, max(1, _HUGE // (head_dim * torch.empty((), dtype=dtype).element_size())))
            for t in (self.k, self.v):
                for plane in t.flatten(0, 1):
                    advise_huge_range(plane.data_ptr(), rows * head_dim * t.element_size())
            self.mapping = threading.Thread(target=prefault, args=([self.k, self.v], rows), name="kv-map", daemon=True)
            self.mapping.start()
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


_HUGE = 1 << 21


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """A CPU tensor of zeros in its own anonymous mapping: the OS hands out zero pages as they are
    first touched, so a pool of gigabytes costs nothing at start (no memset, no page faults: zeroing
    the default 2 GiB pool was ~40% of the engine's start-up) and resident memory grows as the pool
    is used. With ``huge``, advised for transparent huge pages before any page is touched."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8, count=n).view(dtype).view(shape)  # keeps buf alive
    if huge:
        advise_huge_pages(t)
    return t


MADV_POPULATE_WRITE = 23  # Linux 5.14: map pages writable without changing what they hold


def prefault(tensors: list[torch.Tensor], tokens: int) -> None:
    """Map the first ``tokens`` rows of each ``[..., tokens, dim]`` plane of ``tensors``, without
    writing to them (``MADV_POPULATE_WRITE``: safe while the engine writes KV there). A no-op where
    the kernel lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for t in tensors:
            rows, dim = t.shape[-2], t.shape[-1]
            plane = rows * dim * t.element_size()
            length = min(rows, tokens) * dim * t.element_size()
            base = t.data_ptr()
            for i in range(t.numel() // (rows * dim)):
                start = (base + i * plane) & ~4095
                if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_WRITE) != 0:
                    return  # EINVAL on kernels before 5.14: leave the faults to first use
    except (OSError, AttributeError):
        pass


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages under a large CPU tensor, before its pages are first
    touched. A request's KV rows lie anywhere in the pool (pages of one token by default), and with
    4 KB pages the TLB misses cost decode attention ~12% here (32 requests x 200 tokens over a 150 MB
    pool: 345 -> 307 us a layer, measured interleaved). A no-op off Linux, off the CPU, where THP is
    off, or for tensors under 2 MB."""
    n = t.numel() * t.element_size()
    if t.device.type != "cpu" or n < 2 * _HUGE:
        return
    start = (t.data_ptr() + _HUGE - 1) & ~(_HUGE - 1)
    _madvise_huge(start, ((t.data_ptr() + n) & ~(_HUGE - 1)) - start)


def advise_huge_range(ptr: int, n: int) -> None:
    """Huge pages for the 2 MB frames that hold bytes ``[ptr, ptr + n)`` of an anonymous mapping not
    yet touched there (a KV plane's head: its frames reach into the plane before, whose own tail
    rows then sit in a huge page too)."""
    start = ptr & ~(_HUGE - 1)
    _madvise_huge(start, ((ptr + n + _HUGE - 1) & ~(_HUGE - 1)) - start)


def _madvise_huge(start: int, length: int) -> None:
    """MADV_HUGEPAGE over ``[start, start + length)`` (2 MB aligned); a no-op off Linux or where THP is off."""
    if length <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), 14)  # MADV_HUGEPAGE
    except (OSError, AttributeError):
        pass


class IdPool:
    """A free list of ids ``0..n-1``; each id remembers its last owner so an audit can name it."""

    def __init__(self, n: int):
        # Pop from the end: low ids first, which keeps tests' reports readable.
        self._free: list[int] = list(range(n - 1, -1, -1))
        self._is_free = bytearray([1]) * n
        self.last_owner: list[str] = ["never allocated"] * n
        # QUARANTINED ids (not free, never handed out) -> the arrival watermark of the requests that
        # were live when the audit put them there (``Ledger``: released once all of those have ended).
        self.quarantined: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        return len(self.quarantined)

    def is_free(self, i: int) -> bool:
        return bool(self._is_free[i])

    def free_list(self) -> list[int]:
        return list(self._free)

    def _take(self, n: int, owner: str) -> list[int] | None:
        if n > len(self._free):
            return None
        # Reversed: a fresh pool hands out ascending runs (0, 1, 2, ...), so a request's pages are
        # contiguous locations as often as possible (one block per run for a KV transfer).
        ids = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for i in ids:
            self._is_free[i] = 0
            self.last_owner[i] = owner
        return ids

    def _give_back(self, ids: list[int], by: str) -> list[int]:
        """Return ids to the free list; returns those that were already free (double frees), which
        are not added twice. The caller reports them. A quarantined id given back by the owner the
        audit missed leaves quarantine (that owner is done with it). An id outside the pool (a
        negative entry would index from the end) is refused before anything changes."""
        n = len(self._is_free)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise OwnershipError(f"{by} gives back ids outside the pool of {n}: {bad[:20]}")
        doubles = []
        for i in ids:
            if self._is_free[i]:
                doubles.append(i)
                continue
            if self.quarantined:
                self.quarantined.pop(i, None)
            self._is_free[i] = 1
            self._free.append(i)
            self.last_owner[i] = f"freed by {by}"
        return doubles

    # -- quarantine (the ledger's production-mode reclaim) --------------------------------------------
    def quarantine(self, ids: list[int], watermark: int) -> None:
        """Hold ``ids`` (handed out, no owner on the books) aside: not free, never handed out.
        ``watermark``: the newest request arrival when they were found (see ``Ledger``)."""
        for i in ids:
            if self._is_free[i] or i in self.quarantined:
                continue
            self.quarantined[i] = watermark
            self.last_owner[i] = f"quarantine (last owner: {self.last_owner[i]})"

    def unquarantine(self, ids: list[int], owner: str | None = None) -> None:
        """An owner holds ``ids`` again (the audit found it, or it adopted them): they leave
        quarantine and stay handed out."""
        for i in ids:
            if self.quarantined.pop(i, None) is not None and owner is not None:
                self.last_owner[i] = owner

    def release_quarantined(self, ids: list[int], by: str) -> None:
        """``ids`` are proven unowned: back to the free list."""
        ids = [i for i in ids if i in self.quarantined]
        for i in ids:
            del self.quarantined[i]
        self._give_back(ids, by)


class PagePool(IdPool):
    """KV pages. ``alloc`` never hands out a page twice until it is freed."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages)
        self.num_pages = num_pages
        self.page_size = page_size

    def alloc(self, n: int, owner: str) -> list[int] | None:
        return self._take(n, owner)

    def free(self, pages: list[int], by: str) -> list[int]:
        """Returns the pages that were already free (double frees)."""
        return self._give_back(pages, by)

    def set_owner(self, pages: list[int], owner: str) -> None:
        """``pages`` change hands (into the radix tree, to a session); one that was quarantined has
        its owner back."""
        if self.quarantined:
            self.unquarantine(pages)
        for p in pages:
            self.last_owner[p] = owner


class ReqSlotPool(IdPool):
    """Request slots: a live request's row of the page table (which the executor holds, see
    ``engine/page_table.py``). A slot is free, used by one live request, or nothing else."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.num_slots = num_slots

    def alloc(self, owner: str) -> int | None:
        got = self._take(1, owner)
        return got[0] if got else None

    def free(self, slot: int, by: str) -> bool:
        """Returns False (and changes nothing) on a double free (the caller reports it)."""
        return not self._give_back([slot], by)
