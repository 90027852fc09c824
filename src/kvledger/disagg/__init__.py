"""Prefill/decode disaggregation behind SGLang's router, as KV connectors (``connector/base.py``).

``--disaggregation-mode prefill``: requests that carry a bootstrap room run their prompt (chunked,
with the prefix cache) and sample one token; the KV and that token go to the decode server that
claims the room (``prefill.py``). ``decode``: such requests pre-allocate their slot and pages, wait for
the KV (``decode.py``), then decode. Requests without a room are served whole on either. The
built-in transport is ZMQ over TCP with its own wire format (``wire.py``).
"""

from __future__ import annotations

from ..config import EngineConfig
from ..connector import KVConnector
from ..errors import ValidationError
from ..memory.pools import KVBuffer

MODES = ("prefill", "decode")
TRANSFER_BACKENDS = ("tcp", "mooncake")


def check_disagg_config(cfg: EngineConfig) -> None:
    """The PD settings checks that need no model (run by the CLI before anything starts)."""
    mode = cfg.disaggregation_mode
    if mode is None:
        return
    if mode not in MODES:
        raise ValidationError(
            f"disaggregation_mode must be one of {MODES} or null", param="disaggregation_mode"
        )
    if cfg.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
        raise ValidationError(
            f"disaggregation_transfer_backend must be one of {TRANSFER_BACKENDS}",
            param="disaggregation_transfer_backend",
        )
    if not 0 < cfg.disaggregation_bootstrap_port < 65536:
        raise ValidationError(
            "disaggregation_bootstrap_port must be a port number", param="disaggregation_bootstrap_port"
        )
    for name in ("disaggregation_bootstrap_timeout_s", "disaggregation_waiting_timeout_s"):
        if getattr(cfg, name) <= 0:
            raise ValidationError(f"{name} must be > 0", param=name)
    if cfg.disaggregation_transfer_backend == "mooncake":
        from .mooncake import available

        why = available()
        if why is not None:
            raise ValidationError(
                f"the mooncake transfer backend is not installed: {why}",
                param="disaggregation_transfer_backend",
            )
    for bad, what in (
        (cfg.tp_size > 1, "tensor parallelism (tp_size > 1)"),
        (cfg.speculative_algorithm == "STANDALONE", "a draft model (its KV would have to move too)"),
    ):
        if bad:
            raise ValidationError(
                f"PD disaggregation does not support {what} yet", param="disaggregation_mode"
            )


def make_connector(cfg: EngineConfig, kv: KVBuffer, abort) -> KVConnector | None:
    """The connector for ``cfg.disaggregation_mode`` (None when it is off)."""
    if cfg.disaggregation_mode is None:
        return None
    host = cfg.disaggregation_bind_host or "127.0.0.1"
    data = None
    if cfg.disaggregation_transfer_backend == "mooncake":
        from .mooncake import MooncakeData

        data = MooncakeData(kv, host)
    if cfg.disaggregation_mode == "prefill":
        from .prefill import PrefillConnector

        return PrefillConnector(
            kv,
            cfg.page_size,
            host,
            cfg.disaggregation_bootstrap_port,
            cfg.disaggregation_bootstrap_timeout_s,
            data,
        )
    from .decode import DecodeConnector

    return DecodeConnector(
        kv,
        cfg.page_size,
        cfg.disaggregation_bootstrap_port,
        cfg.disaggregation_waiting_timeout_s,
        abort,
        data,
    )
