"""The executor: the seam between the scheduler (with the books) and whatever runs the model.

``execute_model(SchedulerOutput) -> ModelRunnerOutput`` is the whole contract (vLLM's ``Executor``,
nano-vllm's ``ModelRunner.call``). The in-process executor runs the model runner here; a
tensor-parallel executor broadcasts the same (plain-data) ``SchedulerOutput`` to its worker
processes and returns rank 0's sampled tokens. The worker side of the KV connector runs here too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..connector import KVConnector, NoOpConnector
from ..scheduler.output import ModelRunnerOutput, SchedulerOutput
from .runner import ModelRunner


class Executor(ABC):
    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. An empty ``sched.reqs`` runs no forward but still applies the page-table
        changes (pages admitted for KV that is arriving) and reports the connector's finished
        transfers. Raises if the forward fails (the engine then isolates the fault)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook; nothing to release in-process
        """Release worker resources (processes, process groups)."""

    def worker_stats(self) -> list[dict]:
        """Each worker process's ``LlamaModel.compile_stats`` (none in-process)."""
        return []


class InProcessExecutor(Executor):
    """The runner in this process, with the connector's worker side around its forward. A
    tensor-parallel worker rank runs one with ``sample=False`` (no output: rank 0 samples)."""

    def __init__(self, runner: ModelRunner, connector: KVConnector | None = None, sample: bool = True):
        self.runner = runner
        self.connector = (
            connector if connector is not None and not isinstance(connector, NoOpConnector) else None
        )
        self.sample = sample

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        c = self.connector
        if c is not None:
            c.start_load_kv(sched.connector_meta, self.runner.kv_buffer)
        out = self.runner.execute(sched, c) if self.sample else self.runner.execute(sched, c, sample=False)
        if c is not None:
            c.wait_for_save()
            finished = c.get_finished()
            if out is not None:
                out.finished_sending, out.finished_recving = finished
        return out
