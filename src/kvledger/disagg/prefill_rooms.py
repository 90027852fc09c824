"""The prefill side's books of its bootstrap rooms (``prefill.py`` is the connector built on them).

A room is in at most one of: live (its request came and has not finished: ``_live``), claimed
before its request finished (``_claims``), finished with its KV held for the claimant (``_jobs``,
a ``SendJob``), given up by decode before its request finished (``_gone``) or ended here without KV
before any claim came (``_ended``). The engine thread and the I/O thread both read and write these
under ``_lock``; a job's rid reaches the scheduler through ``_done`` (``get_finished``), so its pages
are released through the one release path. Also here: the check that a claim matches the KV held
for its room before any of it is sent.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from . import wire
from .endpoint import TransferStats


@dataclass
class SendJob:
    """A finished request's KV held for its room's claimant (``req X [kv sending]``)."""

    rid: str
    room: int
    pages: list[int]
    num_tokens: int
    crc: int
    first: wire.Done
    created: float = field(default_factory=time.monotonic)
    peer: bytes | None = None  # the claimant's ZMQ identity, once it claimed
    start: int = 0
    sent_at: float | None = None
    direct: bool = False  # the claimant asked for Mooncake writes
    # Tensor parallel: every head of positions staged_start..num_tokens, joined on rank 0 (tp.py);
    # sent from here instead of the pages. ``collected`` is False until the step that joins them ran.
    staged: torch.Tensor | None = None
    staged_start: int = 0
    collected: bool = True


@dataclass
class PendingClaim:
    """A claim that came before its room's request finished: it waits for the KV."""

    peer: bytes
    claim: wire.Claim
    at: float = field(default_factory=time.monotonic)


class PrefillRooms:
    """The rooms' books and the counters of their transfers; every method is called holding ``_lock``."""

    def __init__(self, layout: wire.Layout) -> None:
        self.layout = layout
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._live: dict[int, str] = {}  # room -> rid of a request not finished yet
        self._arrived: dict[int, float] = {}  # room -> when its live request came (the claim timeout)
        self._aborting: set[int] = set()  # live rooms whose request this side already asked to abort
        self._jobs: dict[int, SendJob] = {}  # room -> finished, KV held
        self._claims: dict[int, PendingClaim] = {}  # room -> claimed before its request finished
        # Rooms the decode side gave up on before their request finished here (or arrived): kept for
        # one timeout, so the request does not hold its KV for nobody.
        self._gone: dict[int, tuple[float, str]] = {}  # room -> (when, decode's reason)
        # Rooms whose request ended here without KV to send before any claim came (aborted, timed
        # out): a late claim is answered at once with why, instead of waiting out its timeout.
        self._ended: dict[int, tuple[str, float]] = {}
        self._done: set[str] = set()

    def _job_done(self, job: SendJob, outcome: str) -> None:
        """Report the job's rid through get_finished, so the scheduler releases its pages through the
        one release path (caller holds the lock and removed the job); count the outcome."""
        self._done.add(job.rid)
        self._unstage(job)
        st = self.stats
        if outcome == "ok":
            st.transfers_ok += 1
            st.tokens += job.num_tokens - job.start
            st.bytes += (job.num_tokens - job.start) * self.layout.bytes_per_token
            st.seconds += time.monotonic() - job.created
        elif outcome == "timeout":
            st.transfers_timed_out += 1
        else:
            st.transfers_failed += 1

    def _unstage(self, job: SendJob) -> None:
        """Drop the job's collected block (caller holds the lock)."""
        if job.staged is not None:
            self.stats.stage(-job.staged.nbytes)
            job.staged = None

    def _claimant(self, room: int) -> bytes | None:
        """The peer that claimed ``room`` (caller holds the lock), or None."""
        job = self._jobs.get(room)
        if job is not None and job.peer is not None:
            return job.peer
        pending = self._claims.get(room)
        return pending.peer if pending is not None else None

    def _open_rooms(self, peer: bytes) -> int:
        """Rooms ``peer`` has claimed and not acknowledged (caller holds the lock)."""
        claimed = sum(c.peer == peer for c in self._claims.values())
        return claimed + sum(j.peer == peer for j in self._jobs.values())


def send_refusal(job: SendJob, peer: bytes, claim: wire.Claim, layout: wire.Layout, mooncake: bool) -> str | None:
    """Why ``claim`` may not take the KV ``job`` holds, or None; ``mooncake``: this side writes KV with
    Mooncake (a claim asking for it must name its pages right)."""
    if job.peer not in (None, peer):
        return "the room is claimed by another decode server"
    if claim.layout != layout:
        return f"KV layout differs: prefill {layout}, decode {claim.layout}"
    if claim.num_tokens != job.num_tokens or claim.tokens_crc != job.crc:
        return "the prompt differs from the one prefilled for this room"
    if not 0 <= claim.start <= claim.num_tokens:
        return f"start {claim.start} outside the prompt of {claim.num_tokens} tokens"
    if job.staged is not None and claim.start < job.staged_start:
        return f"start {claim.start} before the KV collected for this room (from {job.staged_start})"
    t = claim.mooncake
    if t is not None and mooncake:
        want = -(-claim.num_tokens // t.page_size) - claim.start // t.page_size if t.page_size > 0 else -1
        if t.page_size < 1 or len(t.pages) != want:
            return f"the claim names {len(t.pages)} pages for tokens {claim.start}..{claim.num_tokens}"
        if any(not 0 <= p < t.num_locations // t.page_size for p in t.pages):
            return "the claim names pages outside its pool"
    return None


def why_ended(reason) -> str:
    """What a claimant is told when the room's request ended without KV to send (``reason``: its finish)."""
    if reason is None:
        return "the prefill request ended"
    return f"the prefill request ended ({reason.type}{': ' + reason.message if reason.message else ''})"
