"""The tensor-parallel executor (rank 0, in the engine process) and the start of the group.

Rank 0 owns the scheduler and the one set of books; each step it broadcasts the step's
``SchedulerOutput`` (plain data, as a typed frame: ``parallel/frames.py``, never pickled) to the other
ranks, every rank runs the same forward on its shards (the collectives inside it keep them in lock
step), and rank 0 samples. Workers own no pages of their
own: they apply the same page-table writes, so a page id means the same page on every rank.

A rank that dies breaks the group: its connections close, the next collective fails,
``TPGroupBroken`` ends the engine process, and the front's restart path brings a new group up. A rank
that hangs stalls the step, which the front's watchdog kills. Workers die with the engine process
(PR_SET_PDEATHSIG), so none is left behind.

The group forms through ``parallel/rendezvous.py``: rank 0 listens on the configured address only,
every rank proves the group's key, and the rendezvous closes once the group is connected.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import uuid

from ..comm import TPComm
from ..config import EngineConfig
from ..engine.executor import Executor
from ..engine.runner import ModelRunner
from ..scheduler.output import ModelRunnerOutput, SchedulerOutput
from . import rendezvous
from .errors import TPGroupBroken
from .frames import CommSetup, Setup, Stats, StatsQuery, Step, Stop, ToWorker, broadcast, gather

log = logging.getLogger("kvledger.engine")


def ranks_of_node(cfg: EngineConfig, node: int) -> range:
    per = cfg.parallel.tp_size // cfg.parallel.nnodes
    return range(node * per, (node + 1) * per)


def launch_workers(
    cfg: EngineConfig, addr: str, ranks: range, key: bytes, log_level: str = "WARNING"
) -> list[subprocess.Popen]:
    """Start the worker ranks of one node as processes (``python -m kvledger.parallel.worker``), the
    group's key in their environment (``rendezvous.handoff_env``)."""
    env = {**os.environ, "KVLEDGER_TP_CONFIG": json.dumps(cfg.flat()), **rendezvous.handoff_env(key)}
    procs = []
    for r in ranks:
        if r == 0:
            continue
        cmd = [sys.executable, "-m", "kvledger.parallel.worker", str(r), addr, log_level]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def join_group(
    cfg: EngineConfig, rank: int, addr: str, key: bytes, listener: socket.socket | None = None
) -> TPComm:
    """Form the group through the authenticated rendezvous (``parallel/rendezvous.py``; rank 0 serves it
    on ``listener``), then close the rendezvous: once every rank is connected nothing needs it."""
    import torch.distributed as dist

    from .netif import gloo_interface

    timeout = datetime.timedelta(seconds=cfg.parallel.dist_timeout_s)
    store = rendezvous.open_store(rank, addr, key, timeout, listener)
    try:
        with gloo_interface(addr):  # the interface the other ranks can reach, not the host name's
            dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.parallel.tp_size, timeout=timeout)
        dist.barrier()  # every rank has read every address from the store
    finally:
        store.close()
    return TPComm(rank, cfg.parallel.tp_size)


def start_group(cfg: EngineConfig) -> tuple[TPComm, list[subprocess.Popen]]:
    """Rank 0's side: listen for the rendezvous, launch this node's other ranks, form the group."""
    key = rendezvous.auth_key(cfg)
    listener = rendezvous.listen(cfg.parallel.dist_init_addr)
    host = rendezvous.split_addr(cfg.parallel.dist_init_addr)[0] if cfg.parallel.dist_init_addr else "127.0.0.1"
    addr = rendezvous.join_addr(host, listener.getsockname()[1])
    level = logging.getLevelName(log.getEffectiveLevel())
    try:
        workers = launch_workers(cfg, addr, ranks_of_node(cfg, 0), key, level)
    except BaseException:
        listener.close()
        raise
    log.info("tensor parallel: %d ranks over %d node(s), rendezvous at %s", cfg.parallel.tp_size, cfg.parallel.nnodes, addr)
    try:
        return join_group(cfg, 0, addr, key, listener), workers
    except BaseException:
        listener.close()  # a no-op once the store took it
        for p in workers:
            p.kill()
        raise


SHM_MAX_FLOATS = 16 * 2**20  # a slot of 64 MiB; larger collectives (huge logit gathers) use gloo


def shm_capacity(cfg: EngineConfig, mc) -> int:
    """Floats one rank's slot holds: a step's hidden states, or its logit rows' vocabulary slice."""
    tokens = (cfg.scheduler.chunked_prefill_size or 512) + cfg.scheduler.max_running_requests * (
        cfg.spec.speculative_num_draft_tokens + 1
    )
    per_vocab = -(-mc.vocab_size // cfg.parallel.tp_size)
    return min(SHM_MAX_FLOATS, tokens * max(mc.hidden_size, per_vocab))


def share_comm(cfg: EngineConfig, mc, workers) -> TPComm:
    """Rank 0, once the model is read and before its shards are built (the model is constructed with
    the communicator its forward uses): when all ranks share this machine, a shared-memory
    communicator, its file told to the workers; gloo's otherwise. Its slot's size needs only the
    settings and the model's shapes (``shm_capacity``), not the pool's."""
    import torch.distributed as dist

    from ..comm import ShmComm

    setup = CommSetup()
    comm = TPComm(0, cfg.parallel.tp_size)
    if cfg.parallel.nnodes == 1:
        setup = CommSetup(f"/dev/shm/kvledger-tp-{uuid.uuid4().hex}", shm_capacity(cfg, mc))
        comm = ShmComm(0, cfg.parallel.tp_size, setup.shm, setup.shm_capacity, create=True,
                       peers_alive=lambda: all(p.poll() is None for p in workers))  # fmt: skip
    broadcast(setup, CommSetup)
    if setup.shm:
        dist.barrier()  # every rank has mapped the file: it can go (the mappings stay)
        os.unlink(setup.shm)
    return comm


def share_pool(num_tokens: int, context: int) -> None:
    """Rank 0, once its pool is sized (from what the model left): tell the workers its shape."""
    broadcast(Setup(num_tokens, context), Setup)


def join_setup(rank: int, size: int) -> tuple[Setup, TPComm]:
    """A worker's side of ``share_comm`` then ``share_pool``: its communicator, then the pool's shape."""
    import torch.distributed as dist

    from ..comm import ShmComm

    shared = broadcast(None, CommSetup)
    comm = TPComm(rank, size)
    if shared.shm:
        comm = ShmComm(rank, size, shared.shm, shared.shm_capacity, create=False)
        dist.barrier()
    return broadcast(None, Setup), comm


class TPExecutor(Executor):
    """Rank 0: encode the step's images (``runner``'s vision encoder: rank 0 alone has one), broadcast
    the step with their rows, run rank 0's shard through ``inner``, return its output."""

    def __init__(self, inner: Executor, workers: list[subprocess.Popen], runner: ModelRunner | None = None):
        self.inner = inner
        self.workers = workers
        self.runner = runner

    def _check_alive(self) -> None:
        dead = [p.pid for p in self.workers if p.poll() is not None]
        if dead:
            raise TPGroupBroken(f"tensor-parallel worker(s) {dead} exited")

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._check_alive()
        if self.runner is not None:
            # Before the broadcast, so a failed encoding is an ordinary step fault: no rank has the step.
            self.runner.encode_images(sched)
        try:
            broadcast(Step.of(sched), ToWorker)
            return self.inner.execute_model(sched)
        except Exception as e:
            # The ranks may now disagree on where they are: no step can be trusted after this one.
            raise TPGroupBroken(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e

    def worker_stats(self) -> list[dict]:
        """Ranks 1..N-1's compile counts, between steps (rank 0's are in this process)."""
        self._check_alive()
        broadcast(StatsQuery(), ToWorker)
        return [{"rank": s.rank, **s.counts} for s in gather(Stats(0, {}), Stats)[1:]]

    def shutdown(self) -> None:
        import torch.distributed as dist

        try:
            if all(p.poll() is None for p in self.workers):
                broadcast(Stop(), ToWorker)
        except Exception:
            log.warning("tensor parallel: could not tell the workers to stop; killing them")
        for p in self.workers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
