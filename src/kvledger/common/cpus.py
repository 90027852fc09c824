"""The cores this process may use: what every thread count defaults to (the kernels' and torch's
pools, a TP rank's share, a DP replica's)."""

from __future__ import annotations

import os


def default_threads() -> int:
    """The cores this process may run on (its affinity: a container's or ``taskset``'s cpuset), not
    the machine's count, which oversubscribes a process given fewer."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)
