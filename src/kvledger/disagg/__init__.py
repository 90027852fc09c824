"""Prefill/decode disaggregation behind SGLang's router, as KV connectors (``connector/base.py``).

``--disaggregation-mode prefill``: requests that carry a bootstrap room wait (holding nothing) until
the decode server claims the room, then run their prompt (chunked, with the prefix cache) and sample
one token; the KV and that token go to the claimant (``prefill.py``). ``decode``: such requests pre-allocate their slot and pages, wait for
the KV (``decode.py``), then decode. Requests without a room are served whole on either. The
built-in transport is ZMQ over TCP with its own wire format (``wire.py``). Under tensor parallelism
rank 0 is the one endpoint and the wire carries every KV head (``tp.py``).
"""

from __future__ import annotations

import logging

from ..config import EngineConfig
from ..connector import KVConnector
from ..memory.pools import KVBuffer
from .tp import RankHeads

log = logging.getLogger("kvledger.disagg")


def make_connector(
    cfg: EngineConfig, kv: KVBuffer, abort, limits=None, kv_heads: int | None = None
) -> KVConnector | None:
    """The connector for ``cfg.disagg.disaggregation_mode`` (None when it is off): rank 0's, over
    ``kv`` (its heads); ``limits``: the engine's, for a prompt a claim carries (a session turn's,
    ``prefill.py``); ``kv_heads`` is the model's count (the wire's layout)."""
    if not cfg.disagg.enabled:
        return None
    host = cfg.disagg.disaggregation_bind_host or "127.0.0.1"
    data = heads = None
    if cfg.parallel.tp_size > 1:
        heads = RankHeads(0, cfg.parallel.tp_size)
    if cfg.disagg.disaggregation_transfer_backend == "mooncake":
        if heads is not None:
            # Mooncake writes (reads) one registered buffer, rank 0's heads; the others' live in
            # other processes. The KV frames through rank 0 carry every head instead.
            log.warning("PD: --disaggregation-transfer-backend mooncake under --tp-size > 1: KV frames instead")
        else:
            from .mooncake import MooncakeData

            data = MooncakeData(kv, host)
    if cfg.disagg.disaggregation_mode == "prefill":
        from .prefill import PrefillConnector

        return PrefillConnector(
            kv,
            cfg.cache.page_size,
            host,
            cfg.disagg.disaggregation_bootstrap_port,
            cfg.disagg.disaggregation_bootstrap_timeout_s,
            abort,
            data,
            limits,
            heads,
            kv_heads,
        )
    from .decode import DecodeConnector

    return DecodeConnector(
        kv,
        cfg.cache.page_size,
        cfg.disagg.disaggregation_bootstrap_port,
        cfg.disagg.disaggregation_waiting_timeout_s,
        abort,
        data,
        heads,
        kv_heads,
    )


def make_worker_side(cfg: EngineConfig, rank: int) -> KVConnector | None:
    """A tensor-parallel worker rank's side of the PD connector: its heads in and out (``tp.py``)."""
    if not cfg.disagg.enabled or cfg.parallel.tp_size == 1:
        return None
    from .tp import PDWorker

    return PDWorker(rank, cfg.parallel.tp_size)
