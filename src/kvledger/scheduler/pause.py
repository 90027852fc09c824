"""Pausing generation (SGLang's ``/pause_generation``): the three modes, applied to the scheduler.

Paused, ``schedule()`` still takes in aborts and timeouts and finishes what they marked, but picks no
batch: nothing is admitted or computed until ``resume``.
"""

from __future__ import annotations

from ..common import FinishReason

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's; its default is abort


def pause(sched, mode: str) -> int:
    """Stop stepping the requests of ``sched`` (the Scheduler) until ``resume``; between steps only
    (a safe point).

    ``abort``: every request is marked, and ends at the next step's safe point through the
    release path (finish reason abort; that step's update emits the outputs). ``retract``: every
    running request is retracted as when the pool runs short (its computed KV committed to the
    prefix cache; a session turn's own pages freed) and requeued in its order, its output so far
    kept, to be recomputed on resume. ``in_place``: requests keep their slots and KV where they
    are. Requests waiting on a KV connector are left to it. Returns how many requests the engine
    holds paused."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"unknown pause mode {mode!r}")
    sched.paused = mode
    if mode == "abort":
        for r in sched.reqs.values():
            r.mark_finish(FinishReason("abort", "aborted by /pause_generation (mode abort)"))
        return 0
    if mode == "retract":
        # Newest first: each goes to the front of the queue, so the oldest ends up first.
        for r in sorted(sched.running, key=lambda r: r.admitted_seq, reverse=True):
            sched.policy.retract(r)
    return len(sched.reqs)
