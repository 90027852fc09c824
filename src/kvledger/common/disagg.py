"""Prefill/decode disaggregation: the router's per-request rendezvous and its validation.

SGLang's router (``--pd-disaggregation``) sends the same body to a prefill and a decode server with
three fields added: ``bootstrap_host`` (the prefill server's host), ``bootstrap_port`` (its bootstrap
port, or null) and ``bootstrap_room`` (a random 63-bit id both sides use to find each other). For a
batch (``text`` a list) each is a list, one entry per prompt. Health checks use the fake host
``2.2.2.2``: no KV moves (see ``disagg/``).

The host and port come from the request body, so a decode server connects only to the prefill
servers it was given (``PrefillPeers``): any other is a 400 naming ``bootstrap_host`` before anything
is held or connected (a body must not point the server at an address of its choosing).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import msgspec

from ..errors import ValidationError

FAKE_BOOTSTRAP_HOST = "2.2.2.2"
LOOPBACK = ("127.0.0.1", "::1", "localhost")  # the default prefill peers' hosts (decode)
_HOSTNAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
MAX_ROOM = 2**63 - 1
DISAGG_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class DisaggParams(msgspec.Struct, frozen=True):
    """Where a request's KV comes from (decode) or goes to (prefill): the room at a prefill server's
    bootstrap endpoint. ``port`` None: the server's own ``--disaggregation-bootstrap-port``."""

    host: str
    port: int | None
    room: int

    @property
    def fake(self) -> bool:
        """A health check or warm-up: nothing is sent or received."""
        return self.host == FAKE_BOOTSTRAP_HOST


def _one(host: Any, port: Any, room: Any, where: str) -> DisaggParams:
    if not isinstance(host, str) or not host or len(host) > 255:
        raise ValidationError(f"bootstrap_host{where} must be a non-empty host name", param="bootstrap_host")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ValidationError(f"bootstrap_port{where} must be a port number or null", param="bootstrap_port")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise ValidationError(
            f"bootstrap_room{where} must be an integer in [0, 2**63)", param="bootstrap_room"
        )
    return DisaggParams(host, port, room)


def parse_disagg(extra: dict[str, Any] | None, num_prompts: int) -> list[DisaggParams | None]:
    """The rendezvous of each of ``num_prompts`` prompts from a body's extra fields: none (a direct
    client), scalars (one prompt) or lists of ``num_prompts`` (a batch). 400 on anything else."""
    extra = extra or {}
    if all(extra.get(k) is None for k in DISAGG_FIELDS):
        return [None] * num_prompts
    host, port, room = (extra.get(k) for k in DISAGG_FIELDS)
    if room is None or host is None:
        raise ValidationError(
            "bootstrap_host and bootstrap_room go together (set by the router in PD mode)",
            param="bootstrap_room",
        )
    if isinstance(room, list):
        if not (isinstance(host, list) and len(host) == len(room) == num_prompts):
            raise ValidationError(
                f"batched bootstrap_host/bootstrap_room must be lists of {num_prompts} (one per prompt)",
                param="bootstrap_room",
            )
        ports = port if isinstance(port, list) else [port] * num_prompts
        if len(ports) != num_prompts:
            raise ValidationError(f"bootstrap_port must be a list of {num_prompts}", param="bootstrap_port")
        return [_one(h, p, r, f"[{i}]") for i, (h, p, r) in enumerate(zip(host, ports, room))]
    if num_prompts != 1:
        raise ValidationError("a batch needs one bootstrap_room per prompt (a list)", param="bootstrap_room")
    return [_one(host, port, room, "")]


def _norm_host(host: str) -> str:
    """One spelling of a host: lower case, IPv6 brackets dropped, an IP address in its canonical form."""
    host = host.strip().lower().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (``localhost`` or a loopback IP)."""
    host = _norm_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_peer(text: str, default_port: int) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or a bare host (``default_port``) -> (host, port); ``ValueError``."""
    text = text.strip()
    host, port = text, str(default_port)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{text!r} is not host:port")
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not port.isdigit():
        raise ValueError(f"{text!r} is not host:port")
    host, port = _norm_host(host), int(port)
    if not 0 < port < 65536 or not (_is_ip(host) or _HOSTNAME.fullmatch(host)):
        raise ValueError(f"{text!r} is not host:port")
    return host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class PrefillPeers:
    """The prefill bootstrap addresses a decode server may connect to: those given
    (``--disaggregation-prefill-peers``), else loopback at the default bootstrap port. Hosts compare
    as written (case and IPv6 spelling aside): a name is not resolved, so list each prefill server
    as the router names it."""

    def __init__(self, entries: list[str] | None, default_port: int):
        self.default_port = default_port
        try:
            given = [parse_peer(e, default_port) for e in entries or [] if e.strip()]
        except ValueError as e:
            raise ValidationError(
                f"disaggregation_prefill_peers: {e}", param="disaggregation_prefill_peers"
            ) from None
        self.peers = set(given) if entries else {(h, default_port) for h in LOOPBACK}

    @property
    def all_loopback(self) -> bool:
        return all(is_loopback(h) for h, _ in self.peers)

    def describe(self) -> list[str]:
        return sorted(self.address(DisaggParams(h, p, 0)) for h, p in self.peers)

    def allows(self, d: DisaggParams) -> bool:
        return d.fake or (_norm_host(d.host), d.port or self.default_port) in self.peers

    def address(self, d: DisaggParams) -> str:
        """``host:port`` of ``d``'s prefill server (``[v6]:port``): what a transport connects to."""
        host, port = _norm_host(d.host), d.port or self.default_port
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def check(self, d: DisaggParams) -> None:
        """400 (``bootstrap_host``) for a rendezvous at a prefill server this one may not reach."""
        if not self.allows(d):
            raise ValidationError(
                f"bootstrap_host {d.host}:{d.port or self.default_port} is not a prefill server this decode "
                "server fetches KV from (--disaggregation-prefill-peers)",
                param="bootstrap_host",
            )
