"""``scheduler/pacing.py``: the step-cost fits and the prompt-token budgets they give (the engine's
side of pacing is tests/engine/test_interleave.py)."""

from __future__ import annotations

import pytest

from kvledger.scheduler.pacing import MIN_PREFILL_TOKENS, LinearCost, StepCosts


def test_the_fit_recovers_a_line_and_keeps_it_through_same_sized_steps():
    lc = LinearCost()
    assert lc.predict(8) is None
    for rows in (1, 4, 8, 64, 128, 2, 32):
        lc.observe(rows, 0.030 + 0.005 * rows)
    w, c = lc.fit
    assert w == pytest.approx(0.030) and c == pytest.approx(0.005)
    # A long run of one size (noisy) says little about a row's cost: the fit stays about the line
    # while the older sizes still weigh, then is kept (no slope from noise over no spread).
    for i in range(1000):
        lc.observe(8, (0.030 + 0.005 * 8) * (1.1 if i % 2 else 0.9))
    w2, c2 = lc.fit
    assert w2 == pytest.approx(w, rel=0.3) and c2 == pytest.approx(c, rel=0.3)


def test_without_spread_the_mean_is_the_prediction():
    lc = LinearCost()
    for t in (0.08, 0.10, 0.09):
        lc.observe(8, t)
    assert lc.fit is None
    assert lc.predict(32) == pytest.approx(0.09, rel=0.02)


def test_larger_forwards_measured_cheaper_do_not_make_a_fit():
    lc = LinearCost()
    for rows, t in ((1, 0.09), (64, 0.05), (128, 0.01)):
        lc.observe(rows, t)
    assert lc.fit is None


def _costs(decode=(0.030, 0.007), prefill=(0.020, 0.005), mixed=(0.040, 0.006)) -> StepCosts:
    sc = StepCosts()
    sc.decode.fit, sc.prefill.fit, sc.mixed.fit = decode, prefill, mixed
    sc.decode.observe(8, 0.086)  # (a fit wins over the mean)
    return sc


def test_unmixed_budget_keeps_prompt_step_plus_decode_step_within_the_ratio():
    sc = _costs()
    for n, batch, ratio in ((1, 8, 2.5), (4, 8, 2.5), (7, 8, 3.0), (16, 32, 2.5), (31, 32, 2.0)):
        b = sc.prefill_budget(n, batch, ratio, cap=2048)
        d = lambda rows: 0.030 + 0.007 * rows  # noqa: E731
        p = 0.020 + 0.005 * b
        assert p + d(n) <= ratio * d(batch) + 1e-9
        assert 0.020 + 0.005 * (b + 1) + d(n) > ratio * d(batch)  # the most that fits
    assert sc.prefill_budget(1, 8, 2.5, cap=16) == 16  # never past the cap


def test_mixed_budget_keeps_the_forward_within_the_ratio():
    sc = _costs()
    for n, batch in ((1, 8), (8, 8), (20, 32)):
        b = sc.mixed_budget(n, batch, 2.5, cap=2048)
        assert 0.040 + 0.006 * (n + b) <= 2.5 * (0.030 + 0.007 * batch) + 1e-9
        assert 0.040 + 0.006 * (n + b + 1) > 2.5 * (0.030 + 0.007 * batch)


def test_no_measurement_means_the_cap_and_a_prompt_always_advances():
    assert StepCosts().prefill_budget(4, 8, 2.5, cap=128) == 128
    assert StepCosts().mixed_budget(4, 8, 2.5, cap=128) == 128
    slow = _costs(prefill=(0.5, 0.1), mixed=(0.5, 0.1))  # a prompt step alone breaks the ratio
    assert slow.prefill_budget(4, 8, 2.5, cap=128) == MIN_PREFILL_TOKENS
    assert slow.mixed_budget(4, 8, 2.5, cap=128) == MIN_PREFILL_TOKENS
    assert slow.prefill_budget(4, 8, 2.5, cap=3) == 3


def test_observe_sorts_forwards_by_kind():
    sc = StepCosts()
    sc.observe(8, 0, 0.09)
    sc.observe(0, 128, 0.6)
    sc.observe(4, 30, 0.2)
    sc.observe(0, 0, 0.01)  # page writes only: nothing
    sc.observe(3, 0, float("nan"))
    assert (sc.decode.observed, sc.prefill.observed, sc.mixed.observed) == (1, 1, 3)
