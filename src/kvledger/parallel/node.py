"""A machine other than node 0 of a multi-node tensor-parallel group (``kvledger serve --node-rank
K``): it runs its ranks and, each time the group breaks (node 0's engine restarted), starts them
again to join the new group. No HTTP here; node 0 serves."""

from __future__ import annotations

import logging
import signal
import time

from ..config import EngineConfig
from .executor import launch_workers, ranks_of_node
from .rendezvous import auth_key

log = logging.getLogger("kvledger.node")


def run_node(cfg: EngineConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s node: %(message)s")
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ranks = ranks_of_node(cfg, cfg.parallel.node_rank)
    key = auth_key(cfg)  # the key file's (or KVLEDGER_DIST_AUTH_KEY's): node 0 checks it before the group forms
    log.info(
        "node %d: ranks %s of %d, joining %s", cfg.parallel.node_rank, list(ranks), cfg.parallel.tp_size, cfg.parallel.dist_init_addr
    )
    while not stop:
        procs = launch_workers(cfg, cfg.parallel.dist_init_addr, ranks, key, "INFO")
        while not stop and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if not stop:
            log.warning("node %d: the group ended; rejoining", cfg.parallel.node_rank)
            time.sleep(1.0)
    return 0
