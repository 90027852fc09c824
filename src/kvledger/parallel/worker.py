"""A tensor-parallel worker rank: join the group, load this rank's shards (compiled too with
``--enable-torch-compile``), then run every step rank 0 broadcasts until it broadcasts ``Stop`` (a
``StatsQuery`` in between is answered with this rank's compile counts). Everything it receives is a
typed frame (``parallel/frames.py``): anything else ends it, unrun.

    python -m kvledger.parallel.worker RANK HOST:PORT [LOG_LEVEL]
    (config in KVLEDGER_TP_CONFIG, the group's key in KVLEDGER_TP_KEY: its launcher sets both)
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


def run(cfg: EngineConfig, rank: int, addr: str, key: bytes) -> None:
    from ..comm import rank_threads
    from ..engine.executor import InProcessExecutor
    from ..kernels import set_threads
    from .executor import join_group, join_setup
    from .frames import Stats, StatsQuery, Step, Stop, ToWorker, broadcast, gather
    from .ranks import build_runner, build_worker_connector

    set_threads(rank_threads(cfg))  # torch's and the kernels' pools: this rank's share of the cores
    log.info("rank %d: joining the group at %s", rank, addr)
    join_group(cfg, rank, addr, key)
    setup, comm = join_setup(rank, cfg.parallel.tp_size)  # the pool's shape, decided by rank 0 once loaded
    runner = build_runner(cfg, comm, setup.num_tokens, setup.context)
    connector = build_worker_connector(cfg, rank, runner)  # the hierarchical cache's data side, or None
    executor = InProcessExecutor(runner, connector, sample=False)
    log.info("rank %d ready", rank)
    try:
        while True:
            match broadcast(None, ToWorker):
                case Stop():
                    return
                case StatsQuery():
                    gather(Stats(rank, runner.model.compile_stats()), Stats)
                case Step() as step:
                    executor.execute_model(step.scheduler_output())
    finally:
        if connector is not None:
            connector.close()


def main() -> int:
    from .rendezvous import key_from_launcher

    rank, addr = int(sys.argv[1]), sys.argv[2]
    level = sys.argv[3] if len(sys.argv) > 3 else "WARNING"
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    die_with_parent()
    cfg = EngineConfig.from_flat(**json.loads(os.environ["KVLEDGER_TP_CONFIG"]))
    try:
        run(cfg, rank, addr, key_from_launcher())  # the key first: nothing this rank starts inherits it
    except Exception as e:  # the group broke (rank 0 gone), or this rank was refused: exit
        log.warning("rank %d leaves the group: %s: %s", rank, type(e).__name__, e)
        return 1
    return 0


if __name__ == "__main__":
    from ..common.quick_exit import exit_now

    exit_now(main())  # sys.exit(main()) but for the interpreter's teardown of torch (common/quick_exit.py)
