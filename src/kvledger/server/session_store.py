"""What the front keeps of each open session: whose it is, and what survives an engine restart.

Ownership. A session belongs to the key that opened it (its owner tag, ``auth.KeyRing.tag``: a keyed
hash, never the key) and to the cache salt of its first turn (kept as a tag too). A turn or a close
naming a session that is not the caller's, or a turn with another salt, gets the same 404 as a
session that does not exist (``check``): another key cannot learn that it exists, continue it or read
its text. A session this store has no record of is refused the same way (it fails closed).

Restarts. The engine holds a session's KV and tokens; if the engine process dies, all of it is gone.
The front keeps, per open session, its id, owner, timeout and token history (the tokens the engine
committed at each completed turn), and re-opens every session on the new engine before it takes
requests; the next turn recomputes the KV from the tokens (the prefix cache helps when turns share it).

The history follows the engine's commit rule (``memory/session_kv.py``): a turn that completes (stop
or length) makes the session ``tokens[:offset] + turn input + turn output``; a turn that ends by
abort, error or a crash leaves it as it was.

A session whose turns sent images is the exception: the images' pixels live in the engine with the
session (``memory/session_kv.py``), not here, so after an engine restart it is dropped (its next turn
gets the 404 of a session that is gone) and it is never journaled.

Bounded: at most ``max_sessions`` records (the engine's cap; expired ones pruned, then the least
recently used dropped), each at most ``context_length`` tokens as 4-byte ints.

With a ``SessionJournal`` (``--session-journal DIR``) every record is mirrored to a file as it changes,
so the records also survive the front's own death: a server started on the same directory loads them
(``load_journal``) and re-opens them on its engine before it serves. Expiry holds across the restart
(a session whose timeout passed while the server was down is dropped, and one that had time left
keeps only that), and a session whose key is no longer configured is dropped.
"""

from __future__ import annotations

import logging
import secrets
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from ..scheduler.sessions import session_not_found
from .auth import ANONYMOUS, KeyRing
from .session_journal import JournalEntry, SessionJournal


@dataclass
class SessionRecord:
    timeout_s: float | None
    owner: str
    salt: str | None = None  # the tag of its turns' cache salt (NO_SALT: none), set by its first turn
    tokens: array = field(default_factory=lambda: array("i"))
    last_used: float = field(default_factory=time.monotonic)
    # A completed turn sent images: their pixels are the engine's (``Session.images``), so the history
    # cannot be recomputed on another engine, and the session is neither journaled nor re-opened.
    images: bool = False

    def expired(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.last_used > self.timeout_s


log = logging.getLogger("kvledger.server")

NO_SALT = "-"  # the salt tag of turns without a cache salt (a tag is hex: never this)


class SessionStore:
    def __init__(
        self,
        max_sessions: int,
        default_timeout_s: float | None,
        journal: SessionJournal | None = None,
        tag: Callable[[bytes], str] | None = None,
    ):
        self.max_sessions = max_sessions
        self.default_timeout_s = default_timeout_s
        self.records: dict[str, SessionRecord] = {}
        self.journal = journal
        # The keyed hash of a cache salt (auth.KeyRing.tag), so that no salt is kept or journaled.
        self.tag = tag or KeyRing([], None, False, secrets.token_bytes(32)).tag

    def load_journal(self, owners: set[str]) -> list[str]:
        """Take the journal's sessions as this store's records (at start) and return their ids:
        those whose owner is among ``owners`` (the keys configured now) and whose timeout has not
        passed; the others' files are removed."""
        if self.journal is None:
            return []
        now, wall = time.monotonic(), time.time()
        for e in self.journal.load():
            idle = max(0.0, wall - e.last_used)
            if e.owner not in owners or (e.timeout_s is not None and idle > e.timeout_s):
                self.journal.remove(e.sid)  # its key is gone, or it expired while the server was down
                continue
            self.records[e.sid] = SessionRecord(e.timeout_s, e.owner, e.salt, e.tokens, now - idle)
        self._trim()
        return list(self.records)

    def opened(self, sid: str, timeout: float | None, owner: str = ANONYMOUS) -> None:
        self.prune()
        self.records[sid] = rec = SessionRecord(timeout if timeout is not None else self.default_timeout_s, owner)
        self._saved(sid, rec)
        self._trim()

    def check(self, sid, owner: str, param: str, salt: str | None = None, turn: bool = False) -> None:
        """Refuse (404, the engine's own words for an unknown session) a caller who may not use
        session ``sid``: another owner's, another salt's (a turn), or one this store does not know.
        A session's first turn binds it to that turn's salt. A ``sid`` that is not a string is left
        to the engine's checks."""
        if not isinstance(sid, str):
            return
        rec = self.records.get(sid)
        if rec is None or rec.owner != owner or rec.expired(time.monotonic()):
            raise session_not_found(sid, param)
        if not turn:
            return
        tag = NO_SALT if salt is None else self.tag(salt.encode())
        if rec.salt is None:
            rec.salt = tag
            self._saved(sid, rec)
        elif rec.salt != tag:
            raise session_not_found(sid, param)

    def _trim(self) -> None:
        while len(self.records) > self.max_sessions:
            self._drop(min(self.records, key=lambda k: self.records[k].last_used))

    def _saved(self, sid: str, rec: SessionRecord) -> None:
        if self.journal is not None and rec.images:
            self.journal.remove(sid)  # (not restorable: see SessionRecord.images)
        elif self.journal is not None:
            wall = time.time() - (time.monotonic() - rec.last_used)
            self.journal.write(JournalEntry(sid, rec.timeout_s, rec.owner, rec.salt, wall, rec.tokens))

    def _drop(self, sid: str) -> None:
        if self.records.pop(sid, None) is not None and self.journal is not None:
            self.journal.remove(sid)

    def closed(self, sid: str) -> None:
        self._drop(sid)

    def turn_ended(
        self, session_params: dict, input_ids: list[int], finish, output_ids: list[int], images: bool = False
    ) -> None:
        """Apply the engine's commit rule to the front's copy of the session (``images``: the turn sent
        some)."""
        sid = session_params.get("id") if isinstance(session_params, dict) else None
        rec = self.records.get(sid) if isinstance(sid, str) else None
        if rec is None or finish is None:
            return
        if finish.type == "abort":
            if finish.code == "session_not_found":
                self.closed(sid)  # the engine no longer has it (expired, or closed elsewhere)
            return
        offset = session_params.get("offset")
        if offset is None:
            offset = len(rec.tokens)
        del rec.tokens[offset:]
        rec.tokens.extend(input_ids)
        rec.tokens.extend(output_ids)
        rec.images = rec.images or images
        rec.last_used = time.monotonic()
        self._saved(sid, rec)

    def prune(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for sid in [s for s, r in self.records.items() if r.expired(now)]:
            self._drop(sid)

    def snapshot(self) -> list[dict]:
        """What the new engine needs to re-open every live session (``restore_sessions``): with how
        long each has been idle, so that it expires when it would have."""
        self.prune()
        gone = [sid for sid, r in self.records.items() if r.images]
        for sid in gone:
            self._drop(sid)  # their images died with the engine: their next turn is a 404
        if gone:
            log.warning("%d session(s) with images not re-opened: their images were the old engine's", len(gone))
        now = time.monotonic()
        return [
            {"id": sid, "timeout": r.timeout_s, "tokens": r.tokens.tolist(), "idle_s": now - r.last_used}
            for sid, r in self.records.items()
        ]
