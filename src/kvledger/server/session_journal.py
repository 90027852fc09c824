"""A directory that keeps the front's session records across a restart of the whole server process.

``SessionStore`` keeps each open session's committed tokens in the front's memory, which survives an
engine restart but not the front's own death (a kill -9 of the server, a replica of ``--dp-size``
that dies). With ``--session-journal DIR`` every change of a record is also written here, one file
per session, so a server started again on the same directory re-opens the sessions on its new engine
before it takes requests; their next turns recompute the KV, as after an engine restart.

The files hold users' text (as tokens), so the directory is this process's user's alone: created
0700, files 0600 (created so, never widened by the umask). A directory that exists already is
tightened to 0700 (its files to 0600) with a warning if it is looser, and refused (the server does
not start) if it is not a directory or another user owns it: someone else could read or plant
sessions there. ``owner.key`` holds the secret of the owner tags (``auth.KeyRing``), so that a
session's tag still names its key after a restart.

A file is ``<sha256 of the id>.session``: one JSON line ``{"id", "timeout", "owner", "salt",
"last_used"}`` (``owner`` and ``salt`` are keyed hashes, never a key or a salt; ``last_used`` wall-clock
seconds, for expiry across the restart), then the tokens as native 4-byte ints. Each write replaces
the whole file (written aside, then renamed), so a crash mid-write leaves the previous version; a
session is at most ``context_length`` tokens, so a write is at most that many 4-byte ints. Files
survive the process, not the machine: nothing is fsynced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import stat
from array import array
from dataclasses import dataclass

from ..errors import ValidationError

log = logging.getLogger("kvledger.server")

SUFFIX = ".session"
SECRET = "owner.key"
SECRET_BYTES = 32
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


@dataclass
class JournalEntry:
    """One session as the journal keeps it."""

    sid: str
    timeout_s: float | None
    owner: str  # the owner tag (auth.KeyRing.tag of its key, or "anonymous")
    salt: str | None  # the tag of the cache salt its turns are bound to; None until its first turn
    last_used: float  # time.time() of its last change
    tokens: array


class SessionJournal:
    def __init__(self, path: str):
        self.path = path
        _private_dir(path)

    def _file(self, sid: str) -> str:
        return os.path.join(self.path, hashlib.sha256(sid.encode()).hexdigest() + SUFFIX)

    def secret(self) -> bytes:
        """The owner tags' secret, made once (``owner.key``, 0600) and read by every later server."""
        path = os.path.join(self.path, SECRET)
        with contextlib.suppress(FileNotFoundError):
            with open(path, "rb") as f:
                _tighten(f.fileno(), 0o600, path)
                key = f.read()
            if len(key) == SECRET_BYTES:
                return key
            log.warning("session journal: %s is not a secret of this server; making a new one", SECRET)
            os.unlink(path)  # the sessions it tagged are dropped (their owners cannot be told)
        key = secrets.token_bytes(SECRET_BYTES)
        _write_new(path, key)
        return key

    def write(self, e: JournalEntry) -> None:
        """Replace the session's file with its current record."""
        path = self._file(e.sid)
        head = {"id": e.sid, "timeout": e.timeout_s, "owner": e.owner, "salt": e.salt, "last_used": e.last_used}
        _write_new(path + ".tmp", json.dumps(head).encode() + b"\n" + e.tokens.tobytes())
        os.replace(path + ".tmp", path)

    def remove(self, sid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(sid))

    def load(self) -> list[JournalEntry]:
        """Every session kept here; an unreadable file is dropped."""
        out = []
        for name in sorted(os.listdir(self.path)):
            path = os.path.join(self.path, name)
            if name.endswith(SUFFIX + ".tmp"):
                os.unlink(path)  # a write that never finished: its previous version is the record
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                with open(fd, "rb") as f:
                    _tighten(f.fileno(), 0o600, path)
                    head, _, body = f.read().partition(b"\n")
                meta = json.loads(head)
                tokens = array("i")
                tokens.frombytes(body)
                e = JournalEntry(meta["id"], meta["timeout"], meta["owner"], meta["salt"], meta["last_used"], tokens)
                if not isinstance(e.sid, str) or path != self._file(e.sid):
                    raise ValueError("the file's name is not its session's")
                if not isinstance(e.owner, str) or not isinstance(e.last_used, (int, float)):
                    raise ValueError("no owner or last use")
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("session journal: dropping %s (%s)", name, err)
                os.unlink(path)
                continue
            out.append(e)
        return out


def _private_dir(path: str) -> None:
    """Make ``path`` a directory only this user can enter, or refuse (ValidationError) one that
    another user owns or that is not a directory."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise ValidationError(f"--session-journal {path} is not a directory", param="session_journal") from None
        if st.st_uid != os.getuid():
            raise ValidationError(
                f"--session-journal {path} belongs to another user (uid {st.st_uid}): it holds users' text; "
                "give a directory of this user's", param="session_journal",
            ) from None  # fmt: skip
        if st.st_mode & 0o077:
            log.warning("session journal: %s was mode %o; tightened to 700", path, stat.S_IMODE(st.st_mode))
            os.chmod(path, 0o700)
    else:
        os.chmod(path, 0o700)  # (makedirs' mode went through the umask; 0700 is what is meant)


def _tighten(fd: int, mode: int, path: str) -> None:
    m = stat.S_IMODE(os.fstat(fd).st_mode)
    if m & ~mode:
        log.warning("session journal: %s was mode %o; tightened to %o", os.path.basename(path), m, mode)
        os.fchmod(fd, mode)


def _write_new(path: str, data: bytes) -> None:
    """Write ``data`` to a new file ``path``, 0600 from its creation (a stale one is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, _NEW, 0o600)
    with open(fd, "wb") as f:
        f.write(data)
