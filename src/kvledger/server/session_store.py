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
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field


@dataclass
class SessionRecord:
    timeout_s: float | None
    tokens: array = field(default_factory=lambda: array("i"))
    last_used: float = field(default_factory=time.monotonic)

    def expired(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.last_used > self.timeout_s


class SessionStore:
    def __init__(self, max_sessions: int, default_timeout_s: float | None):
        self.max_sessions = max_sessions
        self.default_timeout_s = default_timeout_s
        self.records: dict[str, SessionRecord] = {}

    def opened(self, sid: str, timeout: float | None) -> None:
        self.prune()
        self.records[sid] = SessionRecord(timeout if timeout is not None else self.default_timeout_s)
        while len(self.records) > self.max_sessions:
            oldest = min(self.records, key=lambda k: self.records[k].last_used)
            del self.records[oldest]

    def closed(self, sid: str) -> None:
        self.records.pop(sid, None)

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

    def prune(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for sid in [s for s, r in self.records.items() if r.expired(now)]:
            del self.records[sid]

    def snapshot(self) -> list[dict]:
        """What the new engine needs to re-open every live session (``restore_sessions``)."""
        self.prune()
        return [
            {"id": sid, "timeout": r.timeout_s, "tokens": r.tokens.tolist()}
            for sid, r in self.records.items()
        ]
