"""The L3 I/O thread: writes L2 pages to files (stores) and reads files into L2 pages (prefetches).

The scheduler hands it ops and polls ``take_done()`` each step; the op's pages stay in the books
under their owner the whole time (a store pins its pages as ``storing``; a prefetch's pages belong to
the prefetch). Prefetches go first: a request may be waiting for one. File I/O releases the GIL, so
the thread overlaps the engine's forwards.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field

from .host_pool import HostPool
from .storage import FileStorage

log = logging.getLogger(__name__)
_op_ids = itertools.count(1)


@dataclass(eq=False)
class StoreOp:
    """Write ``host_pages[i]`` under ``keys[i]`` (skipped where the key already exists)."""

    keys: list[bytes]
    host_pages: list[int]
    id: int = field(default_factory=lambda: next(_op_ids))


@dataclass(eq=False)
class PrefetchOp:
    """Read ``keys`` into ``host_pages`` for request ``rid``: the prompt's pages ``[start_page, ...)``
    (``tokens`` is the prompt prefix they complete). ``good``: pages read and verified, from the
    first; the read stops at the first miss."""

    rid: str
    tokens: list[int]
    start_page: int
    keys: list[bytes]
    host_pages: list[int]
    deadline: float
    id: int = field(default_factory=lambda: next(_op_ids))
    cancelled: bool = False  # the request ended: stop reading (the pages are freed when it reports)
    good: int = 0
    done: bool = False

    @property
    def owner(self) -> str:
        return f"prefetch for req {self.rid}" + (" [cancelled]" if self.cancelled else " [loading from L3]")


class StorageIO:
    def __init__(self, storage: FileStorage, host: HostPool):
        self.storage = storage
        self.host = host
        self._prefetches: deque[PrefetchOp] = deque()
        self._stores: deque[StoreOp] = deque()
        self._cv = threading.Condition()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        # Tests hold ops in flight by clearing this (an abort, an eviction, a flush while a load runs).
        self.gate = threading.Event()
        self.gate.set()
        self._thread = threading.Thread(target=self._run, name="kvledger-hicache-io", daemon=True)
        self._thread.start()

    def submit(self, op: StoreOp | PrefetchOp) -> None:
        with self._cv:
            (self._prefetches if isinstance(op, PrefetchOp) else self._stores).append(op)
            self._cv.notify()

    def take_done(self) -> list[StoreOp | PrefetchOp]:
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
                while not (self._prefetches or self._stores or self._stop):
                    self._cv.wait()
                if self._stop:
                    return
                op = self._prefetches.popleft() if self._prefetches else self._stores.popleft()
            self.gate.wait()
            try:
                if isinstance(op, PrefetchOp):
                    self._prefetch(op)
                else:
                    self._store(op)
            except Exception:  # a failed op is reported done with what it did; never kills the thread
                log.exception("hicache: L3 op failed")
            self._done.put(op)

    def _store(self, op: StoreOp) -> None:
        for key, p in zip(op.keys, op.host_pages):
            if not self.storage.exists(key):
                self.storage.set(key, self.host.page_view(p).numpy().data)

    def _prefetch(self, op: PrefetchOp) -> None:
        for key, p in zip(op.keys, op.host_pages):
            if op.cancelled or not self.storage.get(key, self.host.page_view(p)):
                break
            op.good += 1
        op.done = True
