"""Where the tensor-parallel group meets, and who may join it.

The group forms through a torch ``TCPStore`` served by rank 0. That store has no authentication of its
own (whoever reaches its port may list, read and write keys), and torch serves it on every interface.
So here:

1. Rank 0 listens on the configured address only: ``--dist-init-addr``'s host, or 127.0.0.1 and a free
   port on one machine (``listen``; the socket is handed to the store, which serves on it).
2. Rank 0 publishes a hello: a fresh nonce and its HMAC under the group's shared key. A rank that
   cannot verify it (it holds another key, or something else answers there) stops before the group
   forms (``TPAuthError``).
3. The group forms through ``AuthStore``: every value a rank writes (gloo's addresses) carries an
   HMAC-SHA256 under a key derived from the shared key and the nonce, over the key name and the value.
   A value without a valid one (written by someone without the key, replayed from another key or from
   an earlier group) is never used: the reader waits for the real one, up to the store's timeout.
4. Once every rank is connected (a barrier in the group), the store closes: nothing listens on the
   rendezvous port while the group runs.

The shared key: ``--dist-auth-key-file`` (every node's copy of one file) or ``KVLEDGER_DIST_AUTH_KEY``;
on one machine without either, a random key made for each launch. Launchers hand it to the ranks they
start in their environment (``KEY_HANDOFF_ENV``, hex), never on a command line (which other users of
the machine can read in ``/proc``).

What this does not do: the collectives themselves (gloo's TCP connections, on the interface that routes
to the rendezvous address) are neither encrypted nor authenticated per message, so nodes must share a
private network; and anyone who reaches the port while a group forms can stop it forming (delete or
overwrite keys), as with any open port. They cannot join it, inject an address into it, or run code.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import secrets
import socket
import stat
import time

import torch.distributed as dist

from ..config import DIST_AUTH_KEY_ENV, EngineConfig
from ..errors import ValidationError
from .errors import TPAuthError

log = logging.getLogger("kvledger.parallel")

KEY_HANDOFF_ENV = "KVLEDGER_TP_KEY"  # launcher -> the ranks it starts: the key, hex
MIN_KEY_BYTES = 16
HELLO = "kvledger/tp/hello"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size


def check_group_key(cfg: EngineConfig) -> None:
    """Before anything starts: several nodes need a shared key, from ``--dist-auth-key-file`` or the
    environment (whether the file reads is ``auth_key``'s, when the group forms)."""
    p = cfg.parallel
    if p.nnodes > 1 and not (p.dist_auth_key_file or os.environ.get(DIST_AUTH_KEY_ENV)):
        raise ValidationError(
            f"several nodes need a shared key: --dist-auth-key-file PATH (or {DIST_AUTH_KEY_ENV})",
            param="dist_auth_key_file",
        )


def auth_key(cfg: EngineConfig) -> bytes:
    """The group's shared key: the key file's content (surrounding whitespace stripped), else
    ``KVLEDGER_DIST_AUTH_KEY``, else on one machine a fresh random key for this launch."""
    path = cfg.parallel.dist_auth_key_file
    if path:
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                key = f.read().strip()
        except OSError as e:
            raise ValidationError(f"--dist-auth-key-file {path}: {e.strerror}", param="dist_auth_key_file") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("--dist-auth-key-file %s can be read by other users of this machine (chmod 600 it)", path)
    elif os.environ.get(DIST_AUTH_KEY_ENV):
        key = os.environ[DIST_AUTH_KEY_ENV].strip().encode()
    elif cfg.parallel.nnodes == 1:
        return secrets.token_bytes(32)
    else:
        raise ValidationError(
            f"several nodes need a shared key: --dist-auth-key-file PATH (or {DIST_AUTH_KEY_ENV})",
            param="dist_auth_key_file",
        )
    if len(key) < MIN_KEY_BYTES:
        raise ValidationError(
            f"the tensor-parallel key is {len(key)} bytes; at least {MIN_KEY_BYTES} are needed "
            "(e.g. openssl rand -hex 32)",
            param="dist_auth_key_file",
        )
    return key


def handoff_env(key: bytes) -> dict[str, str]:
    """The environment entry a launcher gives the ranks it starts."""
    return {KEY_HANDOFF_ENV: key.hex()}


def key_from_launcher() -> bytes:
    """A rank's key, as its launcher handed it (taken out of this process's environment, so that no
    process this one starts inherits it)."""
    raw = os.environ.pop(KEY_HANDOFF_ENV, "")
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if len(key) < MIN_KEY_BYTES:
        raise TPAuthError(f"started without the group's key ({KEY_HANDOFF_ENV}): ranks are started by kvledger")
    return key


def split_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def join_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(addr: str | None) -> socket.socket:
    """Rank 0's rendezvous socket, listening on ``addr``'s host only (None: 127.0.0.1, a free port).
    Binding first and handing the socket to the store also means no other process can take a port
    chosen here before the store serves on it."""
    host, port = split_addr(addr) if addr else ("127.0.0.1", 0)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValidationError(f"--dist-init-addr {addr}: {e}", param="dist_init_addr") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted engine binds at once
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ValidationError(
            f"cannot listen for the tensor-parallel rendezvous on {join_addr(host, port)} ({e.strerror}): "
            "--dist-init-addr must be an address of node 0, as the other nodes reach it",
            param="dist_init_addr",
        ) from None
    return sock


def _mac(key: bytes, label: bytes, data: bytes) -> bytes:
    return hmac.new(key, b"kvledger-tp/" + label + b"\0" + data, hashlib.sha256).digest()


class AuthStore(dist.Store):
    """The store the group forms through: values carry an HMAC under the group's key, and one without a
    valid HMAC is never returned. Only what gloo's rendezvous calls is implemented (``set``, ``get``,
    ``wait``, ``check``); anything else torch might call fails loudly rather than unchecked."""

    def __init__(self, inner: dist.TCPStore, group_key: bytes, timeout: datetime.timedelta):
        super().__init__()
        self._inner: dist.TCPStore | None = inner
        self._key = group_key
        self._timeout_s = timeout.total_seconds()

    def _store(self) -> dist.TCPStore:
        if self._inner is None:
            raise RuntimeError("the tensor-parallel rendezvous was closed once the group formed")
        return self._inner

    def _sign(self, key: str, value: bytes) -> bytes:
        name = key.encode()
        return _mac(self._key, b"value", len(name).to_bytes(4, "big") + name + value)

    def set(self, key: str, value) -> None:
        value = bytes(value)
        self._store().set(key, self._sign(key, value) + value)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        warned = False
        while True:
            raw = self._store().get(key)
            mac, value = raw[:MAC_BYTES], raw[MAC_BYTES:]
            if len(mac) == MAC_BYTES and hmac.compare_digest(mac, self._sign(key, value)):
                return value
            if not warned:
                log.warning("tensor parallel rendezvous: %r holds a value without the group's HMAC "
                            "(forged, or replayed from elsewhere); ignored, waiting for the real one", key)  # fmt: skip
                warned = True
            if time.monotonic() > deadline:
                raise TPAuthError(f"tensor parallel rendezvous: {key!r} never held a value with the group's HMAC")
            time.sleep(0.05)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._store().wait(keys)
        else:
            self._store().wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store().check(keys)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
        self._store().set_timeout(timeout)

    def close(self) -> None:
        """Drop the TCPStore: on rank 0 its server stops and the rendezvous port closes."""
        self._inner = None


def open_store(
    rank: int, addr: str, key: bytes, timeout: datetime.timedelta, listener: socket.socket | None = None
) -> AuthStore:
    """Rank 0 (with its ``listener``): serve the store and publish the hello. Another rank: connect,
    verify the hello (``TPAuthError`` if it does not hold this key)."""
    host, port = split_addr(addr)
    if rank == 0:
        if listener is None:
            raise ValueError("rank 0 serves the store on its listening socket (rendezvous.listen)")
        port = listener.getsockname()[1]
        # The store takes the socket's descriptor (libuv closes it with the server).
        store = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach())  # fmt: skip
        nonce = secrets.token_bytes(NONCE_BYTES)
        store.set(HELLO, nonce + _mac(key, b"hello", nonce))
    else:
        store = dist.TCPStore(host, port, None, False, timeout)
        hello = store.get(HELLO)
        nonce, mac = hello[:NONCE_BYTES], hello[NONCE_BYTES:]
        if len(hello) != NONCE_BYTES + MAC_BYTES or not hmac.compare_digest(mac, _mac(key, b"hello", nonce)):
            raise TPAuthError(
                f"the tensor-parallel rendezvous at {addr} does not hold this rank's key (the nodes' "
                f"--dist-auth-key-file / {DIST_AUTH_KEY_ENV} differ, or something else answers there): not joining"
            )
    return AuthStore(store, _mac(key, b"group", nonce), timeout)
