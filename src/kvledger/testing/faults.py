"""Fault injection for the fault-tolerance tests, chosen once when an engine starts:

* ``KVLEDGER_TEST_FAULT_RIDS=a,b``: a forward holding one of these requests raises, as a kernel bug
  would (the executor is wrapped; the engine must contain the fault to those requests);
* ``KVLEDGER_TEST_CRASH_ON_RID=r``: the engine process exits when ``r`` arrives (the front survives);
* ``KVLEDGER_TEST_STALL_RID=r``: the engine process hangs when ``r`` arrives (the watchdog fires);
* ``KVLEDGER_TEST_STEP_DELAY_S=t``: every forward takes at least ``t`` seconds more, as on a slow
  device (a test's pause or abort then lands mid-generation however fast the machine is);
* ``KVLEDGER_TEST_LEDGER_MISSES_RID=r``: the ledger's walk of owners misses request ``r`` (an
  enumeration bug: a production-mode audit must quarantine the pages and slot it still uses, never
  hand them to another request).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

from ..engine.executor import Executor
from ..memory import Holding
from ..scheduler.output import ModelRunnerOutput, SchedulerOutput


class FaultyExecutor(Executor):
    def __init__(self, inner: Executor, rids: set[str]):
        self.inner = inner
        self.rids = rids

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        bad = next((r.rid for r in sched.reqs if r.rid in self.rids), None)
        if bad is not None:
            raise RuntimeError(f"injected fault for request {bad}")
        return self.inner.execute_model(sched)


class SlowExecutor(Executor):
    def __init__(self, inner: Executor, delay_s: float):
        self.inner = inner
        self.delay_s = delay_s

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if sched.reqs:
            time.sleep(self.delay_s)
        return self.inner.execute_model(sched)


def wrap_executor(executor: Executor) -> Executor:
    rids = {r for r in os.environ.get("KVLEDGER_TEST_FAULT_RIDS", "").split(",") if r}
    if rids:
        executor = FaultyExecutor(executor, rids)
    delay = float(os.environ.get("KVLEDGER_TEST_STEP_DELAY_S") or 0)
    return SlowExecutor(executor, delay) if delay > 0 else executor


def engine_process_hook() -> Callable[[str], None] | None:
    """What the engine process calls with each arriving rid, or None (the normal case)."""
    crash = os.environ.get("KVLEDGER_TEST_CRASH_ON_RID")
    stall = os.environ.get("KVLEDGER_TEST_STALL_RID")
    if not crash and not stall:
        return None

    def hook(rid: str) -> None:
        if rid == crash:
            os._exit(17)  # an engine death the front must survive
        if rid == stall:
            time.sleep(3600)  # a hung step: the front's watchdog must notice

    return hook


def ledger_holdings(holdings: Callable[[], Iterable[Holding]]) -> Callable[[], Iterable[Holding]]:
    """The owner walk the ledger is given: ``holdings`` itself, or without one request's holdings."""
    rid = os.environ.get("KVLEDGER_TEST_LEDGER_MISSES_RID")
    if not rid:
        return holdings
    owner = f"req {rid}"

    def missing() -> Iterable[Holding]:
        return (h for h in holdings() if h.owner != owner and not h.owner.startswith(owner + " "))

    return missing
