"""The L3 I/O thread of one rank: writes L2 pages to files (stores) and reads files into L2 pages
(reads, for prefetches).

The rank's ``TierMover`` hands it ops and takes the finished ones each step; the ops' pages stay in
rank 0's books under their owner the whole time (a store pins its pages as ``storing``; a prefetch's
pages belong to the prefetch) until every rank has reported the op. Reads go first: a request may be
waiting for one. File I/O releases the GIL, so the thread overlaps the engine's forwards.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass

from .host_pool import HostKV
from .storage import FileStorage

log = logging.getLogger(__name__)


@dataclass(eq=False)
class StoreOp:
    """Write ``host_pages[i]`` under ``keys[i]`` (skipped where the key already exists)."""

    id: int
    keys: list[bytes]
    host_pages: list[int]


@dataclass(eq=False)
class ReadOp:
    """Read ``keys`` into ``host_pages``; ``good``: pages read and verified, from the first (the read
    stops at the first miss, or when ``cancelled``)."""

    id: int
    keys: list[bytes]
    host_pages: list[int]
    cancelled: bool = False
    good: int = 0
    done: bool = False


class StorageIO:
    def __init__(self, storage: FileStorage, host: HostKV):
        self.storage = storage
        self.host = host
        self._reads: deque[ReadOp] = deque()
        self._stores: deque[StoreOp] = deque()
        self._cv = threading.Condition()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        # Tests hold ops in flight by clearing this (an abort, an eviction, a flush while a load runs).
        self.gate = threading.Event()
        self.gate.set()
        self._thread = threading.Thread(target=self._run, name="kvledger-hicache-io", daemon=True)
        self._thread.start()

    def submit(self, op: StoreOp | ReadOp) -> None:
        with self._cv:
            (self._reads if isinstance(op, ReadOp) else self._stores).append(op)
            self._cv.notify()

    def take_done(self) -> list[StoreOp | ReadOp]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self.gate.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._reads or self._stores or self._stop):
                    self._cv.wait()
                if self._stop:
                    return
                op = self._reads.popleft() if self._reads else self._stores.popleft()
            self.gate.wait()
            try:
                if isinstance(op, ReadOp):
                    self._read(op)
                else:
                    self._store(op)
            except Exception:  # a failed op is reported done with what it did; never kills the thread
                log.exception("hicache: L3 op failed")
            self._done.put(op)

    def _store(self, op: StoreOp) -> None:
        for key, p in zip(op.keys, op.host_pages):
            if not self.storage.exists(key):
                self.storage.set(key, self.host.page_view(p).numpy().data)

    def _read(self, op: ReadOp) -> None:
        for key, p in zip(op.keys, op.host_pages):
            if op.cancelled or not self.storage.get(key, self.host.page_view(p)):
                break
            op.good += 1
        op.done = True
