"""Seeded sampling through the whole engine: a seeded request's output does not depend on what else
shares its batches (its draws come from (seed, position) alone)."""

from __future__ import annotations

from tests.helpers import assert_idle_clean


def test_seeded_generation_reproducible_across_batch_compositions(make_engine):
    eng = make_engine()
    sp = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    target = [9, 8, 7, 6, 5, 4]
    alone = eng.generate(input_ids=target, sampling_params=sp)["output_ids"]
    others = [[3 + i] * (5 + 11 * i) for i in range(5)]
    batch = eng.generate(
        input_ids=[*others[:2], target, *others[2:]],
        sampling_params=[{"max_new_tokens": 20, "temperature": 1.0}] * 2
        + [sp]
        + [{"max_new_tokens": 9, "temperature": 0.5}] * 3,
    )
    assert batch[2]["output_ids"] == alone
    unseeded = eng.generate(input_ids=target, sampling_params={**sp, "seed": None})["output_ids"]
    assert len(unseeded) == 16
    assert_idle_clean(eng)
