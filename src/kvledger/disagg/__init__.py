"""Prefill/decode disaggregation behind SGLang's router, as KV connectors (``connector/base.py``).

``--disaggregation-mode prefill``: requests that carry a bootstrap room wait (holding nothing) until
the decode server claims the room, then run their prompt (chunked, with the prefix cache) and sample
one token; the KV and that token go to the claimant (``prefill.py``). ``decode``: such requests pre-allocate their slot and pages, wait for
the KV (``decode.py``), then decode. Requests without a room are served whole on either. The
built-in transport is ZMQ over TCP with its own wire format (``wire.py``), every message sealed with
an HMAC under the PD nodes' shared key (``auth.py``). Under tensor parallelism rank 0 is the one
endpoint and the wire carries every KV head (``tp.py``).

What each socket trusts: the prefill side's bootstrap port (a ZMQ ROUTER, bound at
``--disaggregation-bind-host``, loopback by default) applies only messages sealed under the key, and
caps what one peer may claim; the decode side listens on nothing (its DEALERs connect out, only to
the prefill servers it was given: ``common.disagg.PrefillPeers``) and applies only sealed frames from
the peer it claimed from. Mooncake's engine (``mooncake.py``) listens on every interface whatever
the bind host, and authenticates nothing: see there.
"""

from __future__ import annotations

import logging

from ..common.disagg import PrefillPeers, is_loopback
from ..config import EngineConfig
from ..connector import KVConnector
from ..memory.pools import KVBuffer
from .auth import load_key
from .tp import RankHeads

log = logging.getLogger("kvledger.disagg")


def make_connector(
    cfg: EngineConfig, kv: KVBuffer, abort, limits=None, kv_heads: int | None = None, host_sink=None
) -> KVConnector | None:
    """The connector for ``cfg.disagg.disaggregation_mode`` (None when it is off): rank 0's, over
    ``kv`` (its heads); ``limits``: the engine's, for a prompt a claim carries (a session turn's,
    ``prefill.py``); ``kv_heads`` is the model's count (the wire's layout); ``host_sink``: HiSparse's
    host pool, where a decode server's KV may land (None without HiSparse)."""
    if not cfg.disagg.enabled:
        return None
    pd = cfg.disagg
    host = pd.disaggregation_bind_host
    key = load_key(pd.disaggregation_auth_key_file)  # (config.check refused a bad one already)
    if key is None:
        log.warning(
            "PD: no --disaggregation-auth-key-file: messages are not authenticated; any process on this "
            "machine may send them (loopback only)"
        )
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
    if pd.disaggregation_mode == "prefill":
        from .prefill import PrefillConnector

        if not is_loopback(host):
            log.info("PD prefill: the bootstrap port is reachable beyond this machine (%s): sealed messages only",
                     host)  # fmt: skip
        return PrefillConnector(
            kv,
            cfg.cache.page_size,
            host,
            pd.disaggregation_bootstrap_port,
            pd.disaggregation_bootstrap_timeout_s,
            abort,
            data,
            limits,
            heads,
            kv_heads,
            key=key,
            max_claims_per_peer=pd.disaggregation_max_claims_per_peer,
        )
    from .decode import DecodeConnector

    return DecodeConnector(
        kv,
        cfg.cache.page_size,
        pd.disaggregation_bootstrap_port,
        pd.disaggregation_waiting_timeout_s,
        abort,
        data,
        heads,
        kv_heads,
        key=key,
        peers=PrefillPeers(pd.disaggregation_prefill_peers, pd.disaggregation_bootstrap_port),
        host_sink=host_sink,
    )


def make_worker_side(cfg: EngineConfig, rank: int) -> KVConnector | None:
    """A tensor-parallel worker rank's side of the PD connector: its heads in and out (``tp.py``)."""
    if not cfg.disagg.enabled or cfg.parallel.tp_size == 1:
        return None
    from .tp import PDWorker

    return PDWorker(rank, cfg.parallel.tp_size)
