"""The combination fuzz's line in pytest's summary: which allowed pairs this machine did not run.

CUDA pairs run only where torch sees a CUDA device; elsewhere they are counted here, not skipped (CI
fails on skips it cannot explain, and a missing GPU is no failure of the fuzz)."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter) -> None:
    reports = [r for k in ("passed", "failed") for r in terminalreporter.stats.get(k, [])]
    if not any("test_combinations.py::test_combination" in r.nodeid for r in reports):
        return
    from tests import combos

    left = sorted(tuple(sorted(p)) for p in combos.allowed_pairs() - combos.allowed_pairs(combos.runnable_here()))
    terminalreporter.write_line(
        f"combination fuzz: {len(combos.allowed_pairs()) - len(left)} allowed pairs run; not run here "
        f"(no CUDA device): {', '.join(' x '.join(p) for p in left) or 'none'}"
    )
