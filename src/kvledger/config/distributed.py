"""The sections of an engine spread over processes and machines: ``ParallelSettings`` (tensor
parallel) and ``DisaggregationSettings`` (prefill and decode on different servers)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ValidationError
from .base import (
    DISAGGREGATION_MODES,
    TRANSFER_BACKENDS,
    _norm,
    _one_of,
    _positive,
    setting,
)


@dataclass
class ParallelSettings:
    """Tensor parallelism over processes and machines, and the cores each rank uses."""

    tp_size: int = setting(1, "tensor parallel ranks (processes over torch.distributed: gloo on CPUs)", flags=("--tp-size", "--tensor-parallel-size"))
    nnodes: int = setting(1, "machines the TP ranks span (tp_size / nnodes ranks on each; node 0 serves HTTP)")
    node_rank: int = setting(0, "this machine's index (0 serves HTTP)")
    dist_init_addr: str | None = setting(None, "host:port of node 0's rendezvous (node 0 listens on that address only)")
    """host:port of rank 0's rendezvous (multi-node): node 0 listens there only, the others connect;
    None: a free port on 127.0.0.1."""
    dist_auth_key_file: str | None = setting(None, (
        "the key every TP rank proves before the group forms (same file on every node; or "
        "KVLEDGER_DIST_AUTH_KEY); needed with --nnodes > 1"
    ))
    """A file holding the key every rank proves before the group forms (the same file on every node;
    or ``KVLEDGER_DIST_AUTH_KEY``); needed with several nodes, on one machine a random key per launch."""
    dist_timeout_s: float = setting(24 * 3600.0, "seconds a collective may wait (idle ranks wait in one for the next step)", flags=("--dist-timeout",))
    """How long a collective may wait. Idle workers wait in one for the next step, so this is long; a
    rank that dies breaks its connections at once, and a hung one is the front's watchdog's to catch."""
    num_threads: int | None = setting(None, "torch intra-op threads (default: torch's, shared out between ranks)")

    def check(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValidationError("tp_size must be a positive multiple of nnodes", param="tp_size")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValidationError(f"node_rank must be in [0, {self.nnodes})", param="node_rank")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValidationError("several nodes need --dist-init-addr host:port (node 0's)", param="dist_init_addr")
        # A shared key for several nodes (a file, or the environment's) is parallel/rendezvous.py's
        # check_group_key, run by the composition root (launch/validate.py) after this one.
        _positive(self, "dist_timeout_s", "num_threads")


@dataclass
class DisaggregationSettings:
    """Prefill/decode disaggregation behind SGLang's router (``disagg/``)."""

    disaggregation_mode: str | None = setting(None, "this server's part behind sglang-router --pd-disaggregation (default: null, neither)", choices=("null", *DISAGGREGATION_MODES))
    """None | prefill | decode: this server's part. Requests without a bootstrap room are served whole
    either way."""
    disaggregation_bootstrap_port: int = setting(8998, "prefill: where decode servers fetch KV; decode: the port assumed if the router gives none")
    """prefill: the port decode servers fetch KV from; decode: the port assumed when the router
    passes none."""
    disaggregation_bind_host: str = setting("127.0.0.1", (
        "prefill: the address the bootstrap port binds (default: 127.0.0.1; another needs "
        "--disaggregation-auth-key-file); mooncake: the address its engine announces"
    ))
    """prefill: the address the bootstrap port binds (loopback unless set: a bootstrap port reachable
    from other machines is a decision, and needs ``disaggregation_auth_key_file``); with Mooncake, the
    address each side's transfer engine announces."""
    disaggregation_transfer_backend: str = setting("tcp", "tcp: the built-in KV transport (ZMQ over TCP); mooncake: Mooncake's transfer engine (TCP)", choices=TRANSFER_BACKENDS)
    disaggregation_bootstrap_timeout_s: float = setting(300.0, (
        "prefill: release a request's KV if no decode server claims and acknowledges it in this long "
        "(seconds)"
    ), flags=("--disaggregation-bootstrap-timeout",))
    """prefill: how long a finished request's KV waits for its decode server to claim and
    acknowledge it before it is released."""
    disaggregation_waiting_timeout_s: float = setting(300.0, "decode: fail (502) and release a request whose KV has not arrived in this long (seconds)", flags=("--disaggregation-waiting-timeout",))
    disaggregation_auth_key_file: str | None = setting(None, (
        "the key the PD nodes share (the same file on every prefill and decode server, at least 32 "
        "bytes): every PD message is sealed with an HMAC under it (default: "
        "$KVLEDGER_DISAGGREGATION_AUTH_KEY, else none: loopback only)"
    ), metavar="PATH")
    """A file holding the key the PD nodes share (at least 32 bytes; the same on every prefill and
    decode server): every message between them is sealed with an HMAC under it (``disagg/auth.py``).
    None: the environment variable ``KVLEDGER_DISAGGREGATION_AUTH_KEY``, else no key, which only a
    server whose PD sockets are all on loopback may run without."""
    disaggregation_prefill_peers: list[str] | None = setting(  # noqa: RUF009 (a declaration: default None)
        None, (
        "decode: the prefill bootstrap addresses it may fetch KV from, as the router names them; "
        "another is a 400 (default: 127.0.0.1 / localhost at --disaggregation-bootstrap-port)"
    ), nargs="+", metavar="HOST:PORT")
    """decode: the prefill bootstrap addresses (``host:port``, as the router names them: the host of
    each ``--prefill URL`` and its bootstrap port) this server may fetch KV from; a request naming
    another is a 400 before anything is held or connected. None: loopback at
    ``disaggregation_bootstrap_port`` only."""
    disaggregation_max_claims_per_peer: int = setting(512, "prefill: most rooms one decode connection may hold claimed and unacknowledged")
    """prefill: most rooms one decode server (one connection) may have claimed and not acknowledged
    at once; claims beyond it are refused (bounds what one peer makes this server hold)."""

    def __post_init__(self) -> None:
        self.disaggregation_mode = _norm(self.disaggregation_mode, null=("null", "none", ""))
        self.disaggregation_transfer_backend = _norm(self.disaggregation_transfer_backend) or "tcp"
        if isinstance(self.disaggregation_prefill_peers, str):
            self.disaggregation_prefill_peers = self.disaggregation_prefill_peers.split(",")

    @property
    def enabled(self) -> bool:
        return self.disaggregation_mode is not None

    def check(self) -> None:
        """The values alone; the key, the sockets' exposure and the transport's package are checked
        against the machine by ``disagg/start_check.py`` (the composition root runs both)."""
        if not self.enabled:
            return
        _one_of(self.disaggregation_mode, DISAGGREGATION_MODES, "disaggregation_mode", optional=True)
        _one_of(self.disaggregation_transfer_backend, TRANSFER_BACKENDS, "disaggregation_transfer_backend")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValidationError(
                "disaggregation_bootstrap_port must be a port number", param="disaggregation_bootstrap_port"
            )
        _positive(self, "disaggregation_bootstrap_timeout_s", "disaggregation_waiting_timeout_s",
                  "disaggregation_max_claims_per_peer")  # fmt: skip
        if not self.disaggregation_bind_host:
            raise ValidationError(
                "disaggregation_bind_host must be an address", param="disaggregation_bind_host"
            )
