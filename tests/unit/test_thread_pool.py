"""The compute threads on a shared machine (issue 55): the kernels' pool covers every chunk exactly
once whoever is late, its governor and the step's governor drop a thread that keeps losing its core
and take it back once the core is free again, and thread counts follow the process's affinity."""

from __future__ import annotations

import os

import pytest
import torch

from kvledger import kernels
from kvledger.kernels.governor import Governor, ThreadGovernor

needs_kernels = pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")
MS = 1_000_000  # ns


@pytest.fixture
def two_threads():
    before = kernels.pool_stats()["threads"]
    kernels.set_threads(2)
    kernels.set_governor(False)  # these tests look at the split, not the governor's choice
    yield
    kernels.set_governor(True)
    kernels.set_threads(before)


@needs_kernels
@pytest.mark.parametrize("n,grain", [(1, 1), (7, 1), (1000, 7), (4097, 3), (100_000, 1)])
def test_pool_covers_each_item_once(two_threads, n, grain):
    counts = torch.ops.kvledger_cpu.pool_cover(n, grain, 0, 0)
    assert counts[:n].eq(1).all(), counts[:n].unique(return_counts=True)


@needs_kernels
def test_workers_share_the_work_and_a_late_one_takes_less(two_threads):
    # 16 chunks of 2 ms: an awake worker takes several of them.
    on_time = torch.ops.kvledger_cpu.pool_cover(16, 1, 2000, 0)
    assert on_time[:16].eq(1).all() and on_time[16] >= 2, on_time
    # A worker that sleeps 50 ms before each chunk it claims (a thread that lost its core) takes at
    # most the one it claimed first: the caller does the rest and every item is still done once.
    late = torch.ops.kvledger_cpu.pool_cover(16, 1, 2000, 50_000)
    assert late[:16].eq(1).all() and late[16] <= 1, late


@needs_kernels
def test_kernels_on_the_pool_match_one_thread(two_threads):
    x = torch.randn(3000, 64)  # ~12 chunks over the two threads
    w = torch.rand(64) + 0.5
    two = torch.ops.kvledger_cpu.rms_norm(x, w, 1e-6)
    kernels.set_threads(1)
    one = torch.ops.kvledger_cpu.rms_norm(x, w, 1e-6)
    assert torch.equal(one, two)  # rows are independent: the split cannot change a bit


def _replay(threads: int, jobs: list[tuple[int, int, int]]) -> list[int]:
    ends, durs, waits = zip(*jobs) if jobs else ((), (), ())
    return list(torch.ops.kvledger_cpu.governor_replay(threads, list(ends), list(durs), list(waits)))


def _jobs(t0_ms: int, count: int, wait_ns: int, job_ms: int = 1) -> list[tuple[int, int, int]]:
    return [((t0_ms + (i + 1) * job_ms) * MS, job_ms * MS, wait_ns) for i in range(count)]


@needs_kernels
def test_pool_governor_drops_a_late_thread_and_restores_it():
    # 100 ms of 1 ms jobs with short waits (uneven chunks): both threads stay.
    quiet = _replay(2, _jobs(0, 100, 50_000))
    assert set(quiet) == {2}
    # One late window (50 ms of jobs waiting 0.5 ms: a host's hiccup), then quiet: no drop.
    hiccup = _replay(2, _jobs(0, 100, 50_000) + _jobs(100, 50, 500_000) + _jobs(150, 100, 50_000))
    assert set(hiccup) == {2}, hiccup
    # Then every job waits 0.5 ms for a descheduled worker: after three late windows, one thread.
    busy = _jobs(100, 200, 500_000)
    out = _replay(2, _jobs(0, 100, 50_000) + busy)
    assert out[-1] == 1 and 2 not in out[100 + 3 * 50 + 10 :], out[100:]
    # Late still: the probe half a second later finds it so and drops it again.
    still = _jobs(300, 800, 500_000)
    out = _replay(2, _jobs(0, 100, 50_000) + busy + still)
    assert out[-1] == 1 and 2 in out[300:], "the probe came"
    # The core frees: the next probe keeps the thread.
    freed = _jobs(1100, 800, 0)
    out = _replay(2, _jobs(0, 100, 50_000) + busy + still + freed)
    assert out[-1] == 2, out[-50:]


def _governor_judges_waits() -> None:
    """A wait for a worker's chunk is a lost core only when it outlasts the caller's own chunks by 2x:
    three 2 ms chunks on two threads leave one waiting ~a chunk every job (the old 200 us rule dropped
    a thread on that, at quiet, for a job as long as the LM head's at 32 rows); a worker that sleeps 3
    ms before each 0.1 ms chunk (a descheduled one) still gets dropped, once late three windows in a row."""
    before = kernels.pool_stats()["threads"]
    kernels.set_threads(2)
    try:
        # Up to three tries: a loaded box (a CI runner, the suite's own servers) may really take a core
        # for three windows in a row, and then a drop is right. The old rule dropped on every try: each
        # job's wait for the second chunk was ~2 ms, over its 200 us.
        tries = []
        for _ in range(3):
            kernels.set_governor(True)  # resets the rule's windows and counts
            for _ in range(60):  # ~360 ms of compute: several 50 ms windows
                torch.ops.kvledger_cpu.pool_cover(3, 1, 2000, 0)
            tries.append(kernels.pool_stats())
            if tries[-1]["drops"] == 0:
                break
        assert tries[-1]["drops"] == 0 and tries[-1]["active"] == 2, tries
        kernels.set_governor(True)
        for _ in range(100):  # ~300 ms of late jobs: more than three windows in a row
            torch.ops.kvledger_cpu.pool_cover(8, 1, 100, 3000)
        assert kernels.pool_stats()["drops"] >= 1, kernels.pool_stats()
    finally:
        kernels.set_governor(True)
        kernels.set_threads(before)


@needs_kernels
def test_pool_governor_judges_waits_against_the_chunks_length():
    """(``_governor_judges_waits``, in a fresh interpreter: in the suite's long-lived process other
    tests' leftover threads may really take a core three windows in a row, and then a drop is right.)"""
    import subprocess
    import sys

    code = "from tests.unit.test_thread_pool import _governor_judges_waits as f; f()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_step_governor_rule():
    g = Governor(2, drop_share=0.3, probe_min_s=0.5, probe_max_s=2.0, late_windows=3)
    assert [g.observe(t / 10, 0.05) for t in range(1, 4)] == [2] * 3  # quiet
    # One or two late windows between quiet ones (a host's hiccup): no drop.
    assert [g.observe(t, s) for t, s in ((0.35, 0.9), (0.4, 0.0), (0.45, 0.9), (0.5, 0.9), (0.55, 0.0))] == [2] * 5
    assert g.drops == 0
    # A busy neighbour: late window after window, one thread at the third.
    assert g.observe(0.58, 0.5) == 2 and g.observe(0.59, 0.5) == 2
    assert g.observe(0.6, 0.5) == 1 and g.drops == 1
    assert g.observe(0.7, 0.0) == 1  # before the backoff ends
    assert g.observe(1.2, 0.0) == 2 and g.probing  # the probe
    assert g.observe(1.3, 0.6) == 1 and g.backoff == 1.0  # still taken: dropped, backoff doubled
    assert g.observe(2.0, 0.0) == 1  # 1.3 + 1.0 not reached
    assert g.observe(2.4, 0.0) == 2  # probe
    assert g.observe(2.5, 0.1) == 2 and g.restores == 1 and g.backoff == 0.5  # the core is back
    one = Governor(1)
    assert one.observe(1.0, 0.9) == 1  # never below one thread


def test_thread_governor_reads_busy_threads_only():
    now = [0.0]
    stats = {1: (0, 0), 2: (0, 0)}
    applied = []
    tg = ThreadGovernor(
        2, window_s=0.1, read=lambda: dict(stats), apply=applied.append, clock=lambda: now[0], late_windows=1
    )  # (one late window drops here: this test is about which threads count)
    # Thread 1 busy and waiting 60% of the window; thread 2 (a mostly idle socket thread) waits
    # longer but ran little: only thread 1 counts, and it is over the share.
    now[0] = 0.1
    stats[1] = (40 * MS, 60 * MS)
    stats[2] = (1 * MS, 90 * MS)
    assert tg.tick() == 1 and applied == [1]
    # Between windows nothing is read.
    stats[1] = (10**12, 10**12)
    now[0] = 0.15
    assert tg.tick() == 1 and applied == [1]


def test_thread_counts_follow_affinity():
    assert kernels.default_threads() == len(os.sched_getaffinity(0))
