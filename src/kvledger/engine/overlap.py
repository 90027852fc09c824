"""The executor side of overlap scheduling (``scheduler/overlap.py``): one thread runs the launched
steps in order, each after the one before it. ``submit`` returns at once with a future of the step's
``ModelRunnerOutput``; before a step's forward the placeholders it feeds are replaced by the tokens
the step before it sampled, kept here by future id (on a GPU they would stay on the device)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..scheduler.output import ModelRunnerOutput, SchedulerOutput
from ..scheduler.overlap import resolve


class ForwardThread:
    def __init__(self, execute: Callable[[SchedulerOutput], ModelRunnerOutput], device: str = "cpu"):
        self._execute = execute  # the engine's (fault isolation included)
        # The current CUDA device is per thread: the engine's (cuda:N) is this thread's too.
        init = (lambda: torch.cuda.set_device(torch.device(device))) if ":" in device else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvledger-forward", initializer=init)
        # The previous step's sampled tokens by future id: a placeholder is fed only by the step
        # launched right after its own (the scheduler has the token by the launch after that).
        self._tokens: dict[int, int] = {}

    def submit(self, sched: SchedulerOutput) -> Future[ModelRunnerOutput]:
        return self._pool.submit(self._run, sched)

    def _run(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        sched = resolve(sched, self._tokens)
        out = self._execute(sched)
        self._tokens = {
            sr.future: out.tokens[i][0]
            for i, sr in enumerate(sched.reqs)
            if sr.future >= 0 and out.tokens[i]
        }
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
