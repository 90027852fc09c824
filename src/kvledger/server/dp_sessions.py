"""Where the DP front's sessions live: session id -> the replica that opened it, least recently used
first, and which replica a new session goes to (fewest of the front's sessions, ties in turn)."""

from __future__ import annotations


class SessionPlaces:
    """Session id -> replica index. The replicas together hold at most ``max_sessions`` x N; past
    that the oldest entries are sessions they have let go (expired, or dropped for a newer one)
    without the front seeing it: forgotten here too."""

    def __init__(self, replicas: int, max_sessions: int) -> None:
        self.replicas = replicas
        self.by_id: dict[str, int] = {}
        self.cap = max_sessions * replicas

    def __contains__(self, sid: object) -> bool:
        return sid in self.by_id

    def get(self, sid: str) -> int | None:
        return self.by_id.get(sid)

    def remember(self, sid: str, i: int) -> None:
        """``sid`` is on replica ``i``, used now."""
        self.by_id.pop(sid, None)
        self.by_id[sid] = i
        while len(self.by_id) > self.cap:
            del self.by_id[next(iter(self.by_id))]

    def forget(self, sid: str) -> None:
        self.by_id.pop(sid, None)

    def pick(self, up: list[bool], turn: int) -> list[int]:
        """Replicas to open a session on, best first: up ones, fewest of these sessions, ties by
        ``turn`` (a counter the caller advances)."""
        held = [0] * self.replicas
        for i in self.by_id.values():
            held[i] += 1
        n = self.replicas
        order = sorted(range(n), key=lambda i: (held[i], (i - turn) % n))
        return [i for i in order if up[i]]
