"""The scheduler's side of the ledger: what every live request holds, which arrivals are still live,
and the books checked after each step.

``holdings`` names, for the ledger's audit, the pages and slot of every session and of every request
that holds memory (running, waiting for its KV, sending it, or ended while a launched step still
computes it), HiSparse's host pages included. ``arrival_span`` tells the ledger which requests may
still hold or reach pages: quarantined pages wait until every request live when they were found has
ended (``memory/ledger.py``). ``check`` runs after the step's last safe point.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

from ..memory import Holding, request_holding
from ..memory.sparse_kv import SparseKV


class SchedulerBooks:
    def __init__(self, sched):
        self.s = sched  # the Scheduler: its queues, KVManager, config
        self.last_audit = 0.0
        self.was_busy = False  # a batch ran since the last idle audit

    def holdings(self) -> Iterable[Holding]:
        s = self.s
        yield from s.kv_manager.sessions.holdings()
        for r in itertools.chain(s.running, s.waiting_for_kv, s.sending.values(), s.releasing):
            yield request_holding(r)
            if r.sparse is not None:
                yield from SparseKV.holdings(r)

    def arrival_span(self) -> tuple[int, int | None]:
        """(the newest arrival so far, the oldest arrival of a request still live or None): every
        request that may hold or reach pages, those released after a launched step included."""
        s = self.s
        live = [r.arrival_seq for r in itertools.chain(s.reqs.values(), s.releasing)]
        return s.last_arrival, min(live, default=None)

    def check(self) -> None:
        """After the step's last safe point: conservation (every step in strict mode); a full audit
        each time the engine goes idle, and every ``audit_interval_s`` while it is busy."""
        ledger = self.s.kv_manager.ledger
        if ledger.strict:
            ledger.check_conservation()
        now = time.monotonic()
        if self.s.idle:
            if self.was_busy:
                self.was_busy = False
                self.last_audit = now
                ledger.audit()
        elif 0 < self.s.cfg.cache.audit_interval_s <= now - self.last_audit:
            self.last_audit = now
            ledger.audit()
