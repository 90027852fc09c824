"""Prefill/decode disaggregation: the router's per-request rendezvous and its validation.

SGLang's router (``--pd-disaggregation``) sends the same body to a prefill and a decode server with
three fields added: ``bootstrap_host`` (the prefill server's host), ``bootstrap_port`` (its bootstrap
port, or null) and ``bootstrap_room`` (a random 63-bit id both sides use to find each other). For a
batch (``text`` a list) each is a list, one entry per prompt. Health checks use the fake host
``2.2.2.2``: no KV moves (see ``disagg/``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import ValidationError

FAKE_BOOTSTRAP_HOST = "2.2.2.2"
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
