"""One rank's side of the tiers: the data movement the policy (rank 0, ``tiers.py``) decides.

A ``TierMover`` holds this rank's heads of every L2 page (``HostKV``), its L1 (the runner's
``KVBuffer``), its L3 files and their I/O thread. Its keys chain under a namespace that carries its
tp rank and size, so each rank's files are its own heads of the page and a restart with another TP
layout never reads them. It applies the policy's ops (``ops.py``) in order and reports the file ops
that finished (``take_done``); it holds no books: which L2 page is whose is rank 0's business.
"""

from __future__ import annotations

from ..memory.pools import KVBuffer
from .host_pool import HostKV
from .io import ReadOp, StorageIO, StoreOp
from .ops import Cancel, Read, Restore, Save, Store, TierOp, TierReport
from .storage import FileStorage, PageHasher


class TierMover:
    def __init__(self, host: HostKV, hasher: PageHasher, storage: FileStorage | None = None):
        self.host = host
        self.hasher = hasher
        self.storage = storage
        self.io = StorageIO(storage, host) if storage is not None else None
        self.kv: KVBuffer | None = None  # L1's tensors, bound once the runner exists
        self._reads: dict[int, ReadOp] = {}  # op id -> read in flight (a Cancel finds it here)

    def bind(self, kv: KVBuffer) -> None:
        self.kv = kv

    def apply(self, op: TierOp) -> None:
        if isinstance(op, Save):
            self.host.save(self.kv, op.l1_pages, op.host_pages)
        elif isinstance(op, Restore):
            self.host.load(self.kv, op.host_pages, op.l1_pages)
        elif isinstance(op, Store):
            keys = self.hasher.chain(op.tokens)[len(op.tokens) // self.host.page_size - len(op.host_pages) :]
            self.io.submit(StoreOp(op.id, keys, list(op.host_pages)))
        elif isinstance(op, Read):
            keys = self.hasher.chain(op.tokens)[op.start_page :]
            read = ReadOp(op.id, keys, list(op.host_pages))
            self._reads[op.id] = read
            self.io.submit(read)
        elif isinstance(op, Cancel):
            read = self._reads.get(op.id)
            if read is not None:
                read.cancelled = True  # the thread stops at the next page; the op still reports
        else:
            raise TypeError(f"not a tier op: {op!r}")

    def load_layer(self, layer: int, host_pages: list[int], l1_pages: list[int]) -> None:
        self.host.load_layer(self.kv, layer, host_pages, l1_pages)

    def take_done(self) -> TierReport:
        """The file ops finished since the last call: (op id, pages read; 0 for a store)."""
        if self.io is None:
            return []
        out = []
        for op in self.io.take_done():
            if isinstance(op, ReadOp):
                self._reads.pop(op.id, None)
                out.append((op.id, op.good))
            else:
                out.append((op.id, 0))
        return out

    def close(self) -> None:
        if self.io is not None:
            self.io.close()
