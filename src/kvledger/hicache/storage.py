"""The L3 tier: KV pages in files, keyed by chained page hashes.

Keys chain: page ``i``'s key hashes page ``i - 1``'s key and page ``i``'s token ids, from a root that
hashes the per-deployment salt and the *namespace* (model fingerprint, dtype, KV layout, page size, tp
rank and size). So a key names a whole prefix: "how much of this prompt exists" is one walk of
consecutive keys (``batch_exists``), and KV of another model, dtype or deployment can never match.
The salt keeps keys unpredictable: with public hashes one tenant could probe by timing whether
another's prompt is cached (vLLM GHSA-rm76-4mrf-v9r8).

One file per page: ``DIR/ab/<key>.kv``, a header (magic, version, msgpack fields: key, namespace,
payload length, crc32) then the page's bytes. Files are written to a temporary name and renamed, so a
reader never sees half a file; a corrupt, truncated or foreign file is a miss (logged, counted,
removed), never loaded. The directory is created 0700 and files 0600; one that cannot be used (not
creatable, read-only, an unreadable salt) is refused before anything starts (``check_storage_dir``).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import logging
import os
import secrets
import struct
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass, field

import msgspec

from ..errors import ValidationError

log = logging.getLogger(__name__)

MAGIC = b"KVLP"
VERSION = 1
_PREFIX = struct.Struct("<4sBxxxI")  # magic, version, header length
MAX_HEADER = 4096


class PageHasher:
    """Chained page keys under one salt and namespace."""

    def __init__(self, salt: bytes, namespace: str, page_size: int):
        self.page_size = page_size
        self.namespace = namespace
        self.root = hashlib.sha256(b"kvledger-hicache-v1\0" + salt + b"\0" + namespace.encode()).digest()

    def chain(self, tokens: list[int], num_pages: int | None = None) -> list[bytes]:
        """Keys of the first ``num_pages`` full pages of ``tokens`` (all full pages by default)."""
        ps = self.page_size
        n = len(tokens) // ps if num_pages is None else num_pages
        keys, parent = [], self.root
        for i in range(n):
            parent = hashlib.sha256(
                parent + array.array("q", tokens[i * ps : (i + 1) * ps]).tobytes()
            ).digest()
            keys.append(parent)
        return keys


def load_or_create_salt(directory: str) -> bytes:
    """The deployment's salt: ``DIR/salt`` (random on first use, 0600), so that a restarted server on
    the same directory computes the same keys and nobody without the directory can."""
    path = os.path.join(directory, "salt")
    try:
        try:
            with open(path, "rb") as f:
                salt = f.read()
            if len(salt) >= 16:
                return salt
        except FileNotFoundError:
            pass
        salt = secrets.token_bytes(32)
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(salt)
        os.replace(path + ".tmp", path)
    except OSError as e:
        raise _unusable(directory, f"its salt file cannot be read or created ({e.strerror})") from None
    return salt


def make_private_dir(directory: str) -> None:
    """Create ``directory`` 0700 (and tighten it if it exists looser: KV is prompt content)."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        raise _unusable(directory, f"it cannot be created ({e.strerror})") from None
    mode = os.stat(directory).st_mode & 0o777
    if mode != 0o700:
        try:
            os.chmod(directory, 0o700)
        except OSError as e:
            raise _unusable(directory, f"it cannot be made private (0700) ({e.strerror})") from None
        log.warning("hicache: storage dir %s had mode %o; set it to 0700", directory, mode)


def check_storage_dir(directory: str, salt_kept: bool) -> None:
    """What the file tier will do at start, tried before anything starts (the CLI, then the engine):
    the directory exists or can be created, is private (0700), takes a new file, and (``salt_kept``:
    no ``--hicache-salt``) its salt file can be read or created. A directory that fails is refused
    with a ``ValidationError`` naming it and why, rather than served without the tier: a deployment
    that asked for persistence would otherwise lose it silently."""
    make_private_dir(directory)
    try:
        # A probe, not os.access: a read-only mount or a full disk answer only to a real write (and
        # root passes every permission check).
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _unusable(directory, f"it does not take a new file ({e.strerror})") from None
    if salt_kept:
        load_or_create_salt(directory)


def _unusable(directory: str, why: str) -> ValidationError:
    return ValidationError(
        f"--hicache-storage-dir {directory} cannot be used: {why}", param="hicache_storage_dir"
    )


@dataclass
class StorageStats:
    pages_written: int = 0
    pages_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_errors: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> files refused on read

    def as_dict(self) -> dict:
        return {
            "pages_written": self.pages_written,
            "pages_read": self.pages_read,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "write_errors": self.write_errors,
            "rejected": dict(self.rejected),
        }


class FileStorage:
    """get / set / exists over one file per page key. Called from the I/O thread only (reads and
    writes) and from the scheduler (``batch_exists``, figures): file operations are atomic."""

    def __init__(self, directory: str, namespace: str, page_bytes: int):
        make_private_dir(directory)
        self.dir = directory
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.stats = StorageStats()
        self.files, self.bytes = self._walk()  # then kept by set / reject (one walk, at start)

    def _walk(self) -> tuple[int, int]:
        files = size = 0
        for sub in os.scandir(self.dir):
            if sub.is_dir():
                for e in os.scandir(sub.path):
                    if e.name.endswith(".kv"):
                        files += 1
                        size += e.stat().st_size
        return files, size

    def path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.dir, h[:2], h + ".kv")

    def exists(self, key: bytes) -> bool:
        try:
            return os.stat(self.path(key)).st_size > _PREFIX.size
        except OSError:
            return False

    def batch_exists(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, exist (stops at the first missing one)."""
        n = 0
        for k in keys:
            if not self.exists(k):
                break
            n += 1
        return n

    def set(self, key: bytes, payload: memoryview | bytes) -> bool:
        """Write one page (``payload``: exactly ``page_bytes``); False on an I/O error (logged)."""
        path = self.path(key)
        header = msgspec.msgpack.encode(
            {"key": key, "ns": self.namespace, "len": len(payload), "crc": zlib.crc32(payload)}
        )
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
                f.write(header)
                f.write(payload)
            existed = os.path.exists(path)
            os.replace(tmp, path)
        except OSError as e:
            self.stats.write_errors += 1
            log.warning("hicache: could not write %s: %s", path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        self.stats.pages_written += 1
        self.stats.bytes_written += len(payload)
        if not existed:
            self.files += 1
            self.bytes += _PREFIX.size + len(header) + len(payload)
        return True

    def get(self, key: bytes, out) -> bool:
        """Read page ``key`` into ``out`` (a writable uint8 tensor of ``page_bytes``). A missing,
        corrupt, truncated or foreign file is a miss: False, counted, and (but for missing) removed."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.stats.rejected["missing"] += 1
            return False
        except OSError as e:
            return self._reject(path, "unreadable", str(e))
        why = self._check(key, data)
        if why is not None:
            return self._reject(path, why)
        import torch  # the I/O thread's copy into the host page

        payload = memoryview(data)[len(data) - self.page_bytes :]
        out.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.stats.pages_read += 1
        self.stats.bytes_read += self.page_bytes
        return True

    def _check(self, key: bytes, data: bytes) -> str | None:
        if len(data) < _PREFIX.size:
            return "truncated"
        magic, version, hlen = _PREFIX.unpack_from(data)
        if magic != MAGIC or version != VERSION or hlen > MAX_HEADER:
            return "foreign"
        if len(data) < _PREFIX.size + hlen:
            return "truncated"
        try:
            h = msgspec.msgpack.decode(data[_PREFIX.size : _PREFIX.size + hlen])
        except Exception:
            return "corrupt header"
        if not isinstance(h, dict) or h.get("ns") != self.namespace or h.get("key") != key:
            return "foreign"
        if h.get("len") != self.page_bytes:
            return "foreign"
        if len(data) != _PREFIX.size + hlen + self.page_bytes:
            return "truncated"
        if zlib.crc32(memoryview(data)[_PREFIX.size + hlen :]) != h.get("crc"):
            return "corrupt"
        return None

    def _reject(self, path: str, why: str, detail: str = "") -> bool:
        self.stats.rejected[why] += 1
        log.warning(
            "hicache: L3 file %s refused (%s%s); treated as a miss",
            path,
            why,
            f": {detail}" if detail else "",
        )
        try:
            size = os.stat(path).st_size
            os.unlink(path)
            self.files -= 1
            self.bytes -= size
        except OSError:
            pass
        return False

    def figures(self) -> dict:
        return {"l3_files": self.files, "l3_bytes": self.bytes, **self.stats.as_dict()}
