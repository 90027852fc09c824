"""A directory that keeps the front's session records across a restart of the whole server process.

``SessionStore`` keeps each open session's committed tokens in the front's memory, which survives an
engine restart but not the front's own death (a kill -9 of the server, a replica of ``--dp-size``
that dies). With ``--session-journal DIR`` every change of a record is also written here, one file
per session, so a server started again on the same directory re-opens the sessions on its new engine
before it takes requests; their next turns recompute the KV, as after an engine restart.

A file is ``<sha256 of the id>.session``: one JSON line ``{"id", "timeout"}``, then the tokens as
native 4-byte ints. Each write replaces the whole file (written aside, then renamed), so a crash
mid-write leaves the previous version; a session is at most ``context_length`` tokens, so a write is
at most that many 4-byte ints. Files survive the process, not the machine: nothing is fsynced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from array import array

log = logging.getLogger("kvledger.server")

SUFFIX = ".session"


class SessionJournal:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(path, mode=0o700, exist_ok=True)

    def _file(self, sid: str) -> str:
        return os.path.join(self.path, hashlib.sha256(sid.encode()).hexdigest() + SUFFIX)

    def write(self, sid: str, timeout_s: float | None, tokens: array) -> None:
        """Replace the session's file with its current record."""
        path = self._file(sid)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(json.dumps({"id": sid, "timeout": timeout_s}).encode() + b"\n")
            tokens.tofile(f)
        os.replace(tmp, path)

    def remove(self, sid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(sid))

    def load(self) -> list[tuple[str, float | None, array]]:
        """Every session kept here, as ``(id, timeout, tokens)``; an unreadable file is dropped."""
        out = []
        for name in sorted(os.listdir(self.path)):
            path = os.path.join(self.path, name)
            if name.endswith(SUFFIX + ".tmp"):
                os.unlink(path)  # a write that never finished: its previous version is the record
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                with open(path, "rb") as f:
                    head, _, body = f.read().partition(b"\n")
                meta = json.loads(head)
                tokens = array("i")
                tokens.frombytes(body)
                sid, timeout = meta["id"], meta["timeout"]
                if not isinstance(sid, str) or path != self._file(sid):
                    raise ValueError("the file's name is not its session's")
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("session journal: dropping %s (%s)", name, e)
                os.unlink(path)
                continue
            out.append((sid, timeout, tokens))
        return out
