"""The step's thread governor: fewer compute threads while another process holds one of our cores.

torch's intra-op pool (OpenMP; MKL and oneDNN run on it) splits each op evenly over its threads and
closes every parallel region with a barrier that waits for all of them, so a thread the OS has
descheduled for another process stalls the op for a time slice, many times a token. The kernels' own
pool (``csrc/pool.h``) does not wait for late threads and has its own governor; torch's cannot be
changed, only sized. So once per step the model runner calls ``ThreadGovernor.tick()``, which every
``window_s`` reads how long this process's busy threads sat runnable but off a core
(``/proc/self/task/*/schedstat``'s run delay: the kernel's own count of "another task had my core").
Over ``drop_share`` of the wall time in ``late_windows`` windows in a row, the step works with one thread
fewer (one late window is a virtual machine's host taking a vCPU for a moment, not a neighbour); after a
backoff it probes one more for a window and keeps it if the delay stays low (the core came back).

``Governor`` is the rule alone, fed (time, delay share) so that tests can replay synthetic lateness.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class Governor:
    """How many threads to use, from the share of each window the busy threads spent waiting for a
    core. Drops one thread when the share exceeds ``drop_share`` in ``late_windows`` windows in a row
    (the kernels' pool has the same rule: ``csrc/pool.h``); ``probe_min_s`` after a
    drop tries one more for a window, keeping it when the share stays under ``drop_share`` (the
    backoff resets) and dropping it again otherwise (the backoff doubles, up to ``probe_max_s``)."""

    def __init__(
        self,
        threads: int,
        drop_share: float = 0.3,
        probe_min_s: float = 0.5,
        probe_max_s: float = 8.0,
        late_windows: int = 3,
    ):
        self.size = max(1, threads)
        self.late_windows = late_windows
        self.late_run = 0  # windows in a row found late
        self.active = self.size
        self.drop_share = drop_share
        self.probe_min_s = probe_min_s
        self.probe_max_s = probe_max_s
        self.backoff = probe_min_s
        self.probe_at = 0.0
        self.probing = False
        self.drops = 0
        self.restores = 0

    def observe(self, now: float, share: float) -> int:
        """One window ended at ``now`` with ``share`` (run delay / wall time, summed over the busy
        threads); returns the threads for the next window."""
        late = share > self.drop_share
        if self.probing:
            self.probing = False
            if late:
                self.active -= 1
                self.backoff = min(self.probe_max_s, 2 * self.backoff)
            else:
                self.restores += 1
                self.backoff = self.probe_min_s
            self.probe_at = now + self.backoff
        elif late and self.active > 1:
            self.late_run += 1
            if self.late_run >= self.late_windows:
                self.late_run = 0
                self.active -= 1
                self.drops += 1
                self.probe_at = now + self.backoff
        elif self.active < self.size and now >= self.probe_at:
            self.active += 1
            self.probing = True
        if not late:
            self.late_run = 0
        return self.active


def read_schedstats() -> dict[int, tuple[int, int]]:
    """Each thread of this process: (ns on a core, ns runnable but waiting for one)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on, wait, _ = f.read().split()
            out[int(tid)] = (int(on), int(wait))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return out


class ThreadGovernor:
    """Applies ``Governor`` to this process's compute threads (torch's pool via
    ``torch.set_num_threads``). ``tick()`` is cheap between windows (a clock read); at a window's end
    it reads a few small /proc files. A thread counts as busy when it was on a core for at least a
    fifth of the window; only busy threads' delays count (a sleeping or mostly idle thread, such as
    a socket's, waiting briefly is not the step's loss)."""

    def __init__(
        self,
        threads: int,
        window_s: float = 0.1,
        read: Callable[[], dict[int, tuple[int, int]]] = read_schedstats,
        apply: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
        **rule,
    ):
        self.rule = Governor(threads, **rule)
        self.window_s = window_s
        self.read, self.apply, self.clock = read, apply, clock
        self.t0 = clock()
        self.last = read()

    @property
    def active(self) -> int:
        return self.rule.active

    def tick(self) -> int:
        now = self.clock()
        wall = now - self.t0
        if self.rule.size <= 1 or wall < self.window_s:
            return self.rule.active
        cur = self.read()
        wall_ns = wall * 1e9
        delay = 0
        for tid, (on, wait) in cur.items():
            on0, wait0 = self.last.get(tid, (on, wait))
            if on - on0 >= 0.2 * wall_ns:
                delay += wait - wait0
        self.t0, self.last = now, cur
        before = self.rule.active
        after = self.rule.observe(now, delay / wall_ns)
        if after != before:
            self.apply(after)
            log.info(
                "compute threads %d -> %d (busy threads waited %.0f%% of %.2fs for a core)",
                before, after, 100 * delay / wall_ns, wall,
            )  # fmt: skip
        return after
