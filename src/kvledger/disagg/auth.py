"""Authentication of the PD wire: an HMAC-SHA256 seal on every message, under a key the PD nodes share.

Every message (``wire.py``) ends with a seal frame of ``SEAL_BYTES``: the sender's session id (16
random bytes, one per connection), a sequence number, a wall-clock timestamp in milliseconds, and
``HMAC-SHA256(key, label | session | seq | ts | len(frame) | frame ...)`` over every frame before it
(header and K/V payload alike). The label names the direction, so a frame cannot be reflected back
to a node of the other role. A receiver checks, in this order and before it parses anything: the
seal's size, the MAC (``hmac.compare_digest``), that the timestamp is within ``REPLAY_WINDOW_S`` of
its own clock, and that the sequence number is above the last one it accepted from that session.
So a frame that was captured cannot be applied again: within the window its session's counter has
passed it, and after the window its timestamp is stale (a session's counter is kept until then).
Only frames that pass create or advance a session's entry: a peer without the key cannot grow the
table.

Without a key (``--disaggregation-auth-key-file`` / ``KVLEDGER_DISAGGREGATION_AUTH_KEY`` unset) the
seal is still sent, its MAC all zeros, and a receiver checks only its size: that is allowed only when
every PD socket is on loopback (``config/distributed.py``), where it trusts the processes of this machine as the
HTTP port does without ``--api-key``.

The wire is authenticated, not encrypted: run PD over a network you trust with the prompts' KV (or
under a VPN / IPsec), as SGLang's and Mooncake's transports expect.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
import time
from collections import OrderedDict

log = logging.getLogger("kvledger.disagg")

ENV_KEY = "KVLEDGER_DISAGGREGATION_AUTH_KEY"  # the key itself, when no key file is given
MIN_KEY_BYTES = 32  # e.g. ``openssl rand -hex 32`` (64 characters)
SESSION_BYTES = 16
MAC_BYTES = 32
_HEAD = struct.Struct(">QQ")  # sequence number, timestamp (ms since the epoch)
SEAL_BYTES = SESSION_BYTES + _HEAD.size + MAC_BYTES
# How far a frame's timestamp may be from the receiver's clock (transit + clock skew between the
# PD machines); a session's last sequence number is kept this long after its last frame.
REPLAY_WINDOW_S = 300.0
# Labels of the two directions: a seal made for one never opens in the other.
TO_PREFILL = b"kvledger-pd-v3 decode->prefill"
TO_DECODE = b"kvledger-pd-v3 prefill->decode"


class AuthError(Exception):
    """A frame whose seal does not open: refused and counted by the caller, never applied."""


def load_key(path: str | None) -> bytes | None:
    """The PD nodes' shared key: the contents of ``path`` (surrounding whitespace stripped), else the
    environment variable ``KVLEDGER_DISAGGREGATION_AUTH_KEY``, else None. ``ValueError`` for a file
    that cannot be read or a key shorter than ``MIN_KEY_BYTES``."""
    if path:
        try:
            with open(path, "rb") as f:
                key = f.read().strip()
            mode = os.stat(path).st_mode
        except OSError as e:
            raise ValueError(f"cannot read the PD auth key file {path!r}: {e.strerror or e}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("PD: the auth key file %s is readable by other users (chmod 600 it)", path)
        where = path
    else:
        env = os.environ.get(ENV_KEY)
        if not env:
            return None
        key, where = env.strip().encode(), ENV_KEY
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"the PD auth key ({where}) has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
            "(e.g. `openssl rand -hex 32`)"
        )
    return key


def _mac(key: bytes, label: bytes, head: bytes, parts) -> bytes:
    h = hmac.new(key, label, hashlib.sha256)
    h.update(head)
    for p in parts:
        view = memoryview(p)
        h.update(view.nbytes.to_bytes(8, "big"))
        h.update(view)
    return h.digest()


class Sealer:
    """One sending session (one per connection): seals each message's frames in order."""

    def __init__(self, key: bytes | None, label: bytes):
        self.key, self.label = key, label
        self.session = secrets.token_bytes(SESSION_BYTES)
        self.seq = 0

    def seal(self, parts) -> bytes:
        """The seal frame of a message made of ``parts`` (bytes-like), sent in this order."""
        self.seq += 1
        head = self.session + _HEAD.pack(self.seq, int(time.time() * 1000))
        if self.key is None:
            return head + bytes(MAC_BYTES)
        return head + _mac(self.key, self.label, head, parts)


class Opener:
    """The receiving end of every session sent to one node: checks each message's seal."""

    def __init__(self, key: bytes | None, label: bytes, window_s: float = REPLAY_WINDOW_S):
        self.key, self.label, self.window_s = key, label, window_s
        self._last: dict[bytes, tuple[int, float]] = {}  # session -> (last sequence number, its time)
        self._pruned = time.time()

    @property
    def authenticates(self) -> bool:
        return self.key is not None

    def open(self, parts, seal, now: float | None = None) -> None:
        """Accept the message ``parts`` + ``seal`` or raise ``AuthError`` saying why."""
        seal = memoryview(seal)
        if seal.nbytes != SEAL_BYTES:
            raise AuthError(f"a seal of {seal.nbytes} bytes (want {SEAL_BYTES})")
        if self.key is None:
            return
        head, mac = bytes(seal[: SEAL_BYTES - MAC_BYTES]), seal[SEAL_BYTES - MAC_BYTES :]
        if not hmac.compare_digest(mac, _mac(self.key, self.label, head, parts)):
            if not any(mac):
                raise AuthError("an unauthenticated frame (a sender without --disaggregation-auth-key-file?)")
            raise AuthError("a frame whose MAC does not match (another key?)")
        session = head[:SESSION_BYTES]
        seq, ts_ms = _HEAD.unpack(head[SESSION_BYTES:])
        now = time.time() if now is None else now
        ts = ts_ms / 1000
        if abs(now - ts) > self.window_s:
            raise AuthError(
                f"a frame stamped {now - ts:+.0f}s from this clock (window {self.window_s:.0f}s): "
                "replayed, or the PD machines' clocks disagree"
            )
        last = self._last.get(session)
        if last is not None and seq <= last[0]:
            raise AuthError(f"a replayed frame (sequence {seq}, last accepted {last[0]})")
        self._last[session] = (seq, max(ts, last[1]) if last is not None else ts)
        if now - self._pruned > self.window_s / 10:
            self._prune(now)

    def _prune(self, now: float) -> None:
        """Forget sessions silent for longer than the window: any frame of theirs is stale now."""
        self._pruned = now
        for s in [s for s, (_, ts) in self._last.items() if now - ts > self.window_s]:
            del self._last[s]


class Sealers:
    """A sender's sessions by peer (the prefill side: one per connected decode server), the least
    recently used dropped past ``limit`` (a dropped peer just gets a new session)."""

    def __init__(self, key: bytes | None, label: bytes, limit: int = 4096):
        self.key, self.label, self.limit = key, label, limit
        self._by_peer: OrderedDict[bytes, Sealer] = OrderedDict()

    def __call__(self, peer: bytes) -> Sealer:
        s = self._by_peer.get(peer)
        if s is None:
            s = self._by_peer[peer] = Sealer(self.key, self.label)
            if len(self._by_peer) > self.limit:
                self._by_peer.popitem(last=False)
        else:
            self._by_peer.move_to_end(peer)
        return s
