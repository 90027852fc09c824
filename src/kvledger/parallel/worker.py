"""A tensor-parallel worker rank: join the group, load this rank's shards (compiled too with
``--enable-torch-compile``), then run every step rank 0 broadcasts until it broadcasts None (a
``StatsQuery`` in between is answered with this rank's compile counts).

    python -m kvledger.parallel.worker RANK HOST:PORT [LOG_LEVEL]   (config in KVLEDGER_TP_CONFIG)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys

from ..config import EngineConfig

log = logging.getLogger("kvledger.worker")


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent (the engine, or a node launcher) dies,
    so a crashed engine never leaves ranks behind."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run(cfg: EngineConfig, rank: int, addr: str) -> None:
    import torch

    from ..engine.core import build_runner, build_worker_connector
    from ..engine.executor import InProcessExecutor
    from .comm import rank_threads
    from .executor import StatsQuery, broadcast, gather, join_group, join_setup

    if threads := rank_threads(cfg):
        torch.set_num_threads(threads)
    join_group(cfg, rank, addr)
    setup, comm = join_setup(rank, cfg.parallel.tp_size)  # the pool's shape, decided by rank 0 once loaded
    runner = build_runner(cfg, comm, setup["num_tokens"], setup["context"])
    connector = build_worker_connector(cfg, rank, runner)  # the hierarchical cache's data side, or None
    executor = InProcessExecutor(runner, connector, sample=False)
    log.info("rank %d ready", rank)
    try:
        while True:
            msg = broadcast(None)
            if msg is None:
                return
            if isinstance(msg, StatsQuery):
                gather({"rank": rank, **runner.model.compile_stats()})
                continue
            executor.execute_model(msg)
    finally:
        if connector is not None:
            connector.close()


def main() -> int:
    rank, addr = int(sys.argv[1]), sys.argv[2]
    level = sys.argv[3] if len(sys.argv) > 3 else "WARNING"
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    die_with_parent()
    cfg = EngineConfig.from_flat(**json.loads(os.environ["KVLEDGER_TP_CONFIG"]))
    try:
        run(cfg, rank, addr)
    except Exception as e:  # the group broke (rank 0 gone): exit, a new group will be started
        log.warning("rank %d leaves the group: %s: %s", rank, type(e).__name__, e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
