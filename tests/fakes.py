"""Test doubles for the executor seam: a fake model whose next token is a function of the previous
one, run behind the real ``InProcessExecutor`` (so a KV connector's worker side is called as usual)."""

from __future__ import annotations

from kvledger.engine.executor import InProcessExecutor
from kvledger.engine.page_table import PageTable
from kvledger.engine.runner import accepted_run
from kvledger.scheduler import ModelRunnerOutput, SchedulerOutput

V = 251  # the fake model's "vocabulary" (inside the tiny model's 256)


def nxt(tok: int) -> int:
    """The fake model: the next token is a function of the previous one."""
    return (tok * 7 + 3) % V


def chain(tok: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        tok = nxt(tok)
        out.append(tok)
    return out


class FakeRunner:
    """Applies the page writes to its own page table (as a worker would) and checks that every
    location it would write belongs to a page the scheduler's books give the request."""

    kv_buffer = None

    def __init__(self, core):
        self.core = core
        kvm = core.kv_manager
        self.table = PageTable(kvm.slots.num_slots, core.limits.context_length + 64, kvm.page_size)
        self.steps = 0

    def execute(self, sched: SchedulerOutput, connector=None) -> ModelRunnerOutput:
        self.steps += 1
        self.table.apply(sched.page_writes)
        kvm = self.core.kv_manager
        out = ModelRunnerOutput.empty(len(sched.reqs))
        for i, r in enumerate(sched.reqs):
            req = self.core.scheduler.reqs[r.rid]
            locs = self.table.req_to_token[r.slot, r.start : r.start + r.num_tokens]
            assert set((locs // kvm.page_size).tolist()) <= set(req.pages), (
                "a write outside the request's pages"
            )
            if r.sampling is None:
                continue
            verified = r.token_ids[r.num_tokens - 1 - r.num_draft :]
            draws = [nxt(t) for t in verified]
            n = accepted_run(draws, r.token_ids[r.num_tokens - r.num_draft :])
            out.tokens[i] = draws[:n]
            out.logprobs[i] = [None] * n
            out.top_logprobs[i] = [None] * n
        return out


def use_fake_model(core, runner: FakeRunner | None = None) -> FakeRunner:
    """Swap the engine's executor for the real in-process one around a ``FakeRunner``."""
    runner = runner or FakeRunner(core)
    core.executor = InProcessExecutor(runner, core.scheduler.connector)
    return runner
