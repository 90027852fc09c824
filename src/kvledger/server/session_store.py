"""What the front keeps of each open session so that it survives an engine restart.

The engine holds a session's KV and tokens; if the engine process dies, all of it is gone. The front
keeps, per open session, its id, timeout and token history (the tokens the engine committed at each
completed turn), and re-opens every session on the new engine before it takes requests; the next turn
recomputes the KV from the tokens (the prefix cache helps when turns share it).

The history follows the engine's commit rule (``memory/session_kv.py``): a turn that completes (stop
or length) makes the session ``tokens[:offset] + turn input + turn output``; a turn that ends by
abort, error or a crash leaves it as it was.

Bounded: at most ``max_sessions`` records (the engine's cap; expired ones pruned, then the least
recently used dropped), each at most ``context_length`` tokens as 4-byte ints.

With a ``SessionJournal`` (``--session-journal DIR``) every record is mirrored to a file as it changes,
so the records also survive the front's own death: a server started on the same directory loads them
(``load_journal``) and re-opens them on its engine before it serves.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from .session_journal import SessionJournal


@dataclass
class SessionRecord:
    timeout_s: float | None
    tokens: array = field(default_factory=lambda: array("i"))
    last_used: float = field(default_factory=time.monotonic)

    def expired(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.last_used > self.timeout_s


class SessionStore:
    def __init__(
        self, max_sessions: int, default_timeout_s: float | None, journal: SessionJournal | None = None
    ):
        self.max_sessions = max_sessions
        self.default_timeout_s = default_timeout_s
        self.records: dict[str, SessionRecord] = {}
        self.journal = journal

    def load_journal(self) -> list[str]:
        """Take the journal's sessions as this store's records (at start); returns their ids."""
        if self.journal is None:
            return []
        for sid, timeout, tokens in self.journal.load():
            self.records[sid] = SessionRecord(timeout, tokens)
        self._trim()
        return list(self.records)

    def opened(self, sid: str, timeout: float | None) -> None:
        self.prune()
        self.records[sid] = rec = SessionRecord(timeout if timeout is not None else self.default_timeout_s)
        self._saved(sid, rec)
        self._trim()

    def _trim(self) -> None:
        while len(self.records) > self.max_sessions:
            self._drop(min(self.records, key=lambda k: self.records[k].last_used))

    def _saved(self, sid: str, rec: SessionRecord) -> None:
        if self.journal is not None:
            self.journal.write(sid, rec.timeout_s, rec.tokens)

    def _drop(self, sid: str) -> None:
        if self.records.pop(sid, None) is not None and self.journal is not None:
            self.journal.remove(sid)

    def closed(self, sid: str) -> None:
        self._drop(sid)

    def turn_ended(self, session_params: dict, input_ids: list[int], finish, output_ids: list[int]) -> None:
        """Apply the engine's commit rule to the front's copy of the session."""
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
        rec.last_used = time.monotonic()
        self._saved(sid, rec)

    def prune(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for sid in [s for s, r in self.records.items() if r.expired(now)]:
            self._drop(sid)

    def snapshot(self) -> list[dict]:
        """What the new engine needs to re-open every live session (``restore_sessions``)."""
        self.prune()
        return [
            {"id": sid, "timeout": r.timeout_s, "tokens": r.tokens.tolist()}
            for sid, r in self.records.items()
        ]
