"""Fault injection for the fault-tolerance tests, chosen once when an engine starts:

* ``KVLEDGER_TEST_FAULT_RIDS=a,b``: a forward holding one of these requests raises, as a kernel bug
  would (the executor is wrapped; the engine must contain the fault to those requests);
* ``KVLEDGER_TEST_CRASH_ON_RID=r``: the engine process exits when ``r`` arrives (the front survives);
* ``KVLEDGER_TEST_STALL_RID=r``: the engine process hangs when ``r`` arrives (the watchdog fires).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..engine.executor import Executor
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


def wrap_executor(executor: Executor) -> Executor:
    rids = {r for r in os.environ.get("KVLEDGER_TEST_FAULT_RIDS", "").split(",") if r}
    return FaultyExecutor(executor, rids) if rids else executor


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
