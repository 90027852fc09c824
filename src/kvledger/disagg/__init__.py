"""Prefill/decode disaggregation behind SGLang's router, as KV connectors (``connector/base.py``).

``--disaggregation-mode prefill``: requests that carry a bootstrap room wait (holding nothing) until
the decode server claims the room, then run their prompt (chunked, with the prefix cache) and sample
one token; the KV and that token go to the claimant (``prefill.py``). ``decode``: such requests pre-allocate their slot and pages, wait for
the KV (``decode.py``), then decode. Requests without a room are served whole on either. The
built-in transport is ZMQ over TCP with its own wire format (``wire.py``).
"""

from __future__ import annotations

from ..config import EngineConfig
from ..connector import KVConnector
from ..memory.pools import KVBuffer


def make_connector(cfg: EngineConfig, kv: KVBuffer, abort, limits=None) -> KVConnector | None:
    """The connector for ``cfg.disagg.disaggregation_mode`` (None when it is off); ``limits``: the
    engine's, for a prompt a claim carries (a session turn's, ``prefill.py``)."""
    if not cfg.disagg.enabled:
        return None
    host = cfg.disagg.disaggregation_bind_host or "127.0.0.1"
    data = None
    if cfg.disagg.disaggregation_transfer_backend == "mooncake":
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
        )
    from .decode import DecodeConnector

    return DecodeConnector(
        kv,
        cfg.cache.page_size,
        cfg.disagg.disaggregation_bootstrap_port,
        cfg.disagg.disaggregation_waiting_timeout_s,
        abort,
        data,
    )
