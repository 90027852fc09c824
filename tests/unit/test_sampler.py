"""Batched sampling: seeds independent of the batch, sane edge values, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvledger.common.sampling import SamplingParams, SamplingRow
from kvledger.model import Sampler


def _row(seed=None, position=3, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(seed=seed, **kw), position, [1, 2, 3], [4, 4, 5])


def test_greedy_is_argmax():
    logits = torch.randn(4, 100)
    res = Sampler().sample(logits, [_row(temperature=0.0) for _ in range(4)])
    assert res.tokens == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_equal_maxima_as_argmax_does():
    """The host sampler's greedy pick is ``max(dim).indices`` (faster on the CPU): on ties it must be
    argmax's first index, or greedy output would depend on which op ran."""
    torch.manual_seed(0)
    logits = (torch.randn(64, 49152) * 2).round()  # many rows with tied maxima
    logits[:, 7] = logits[:, 40000] = logits.max() + 1  # and two equal winners in every row
    res = Sampler().sample(logits, [_row(temperature=0.0) for _ in range(64)])
    assert res.tokens == logits.argmax(-1).tolist() == [7] * 64


@pytest.mark.parametrize("temperature,top_p", [(1e-9, 1.0), (1e-4, 1e-9), (1.0, 1e-12), (100.0, 1.0)])
def test_extreme_values_never_nan(temperature, top_p):
    logits = torch.randn(3, 50) * 30
    res = Sampler().sample(
        logits, [_row(temperature=temperature, top_p=top_p, logprobs=True) for _ in range(3)]
    )
    assert all(0 <= t < 50 for t in res.tokens)
    assert all(lp is not None and math.isfinite(lp) for lp in res.logprobs)
    if temperature < 1e-3 or top_p < 1e-6:
        assert res.tokens == logits.argmax(-1).tolist()


def test_top_k_1_and_min_p_1_are_greedy():
    logits = torch.randn(2, 64)
    rows = [_row(temperature=1.0, top_k=1), _row(temperature=1.0, min_p=1.0)]
    assert Sampler().sample(logits, rows).tokens == logits.argmax(-1).tolist()


def test_seeded_rows_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 200)
    alone = [
        Sampler(seed=1).sample(logits[i : i + 1], [_row(seed=42, temperature=1.0)]).tokens[0]
        for i in range(3)
    ]
    # Same rows amid different neighbours, in another position, with another engine seed.
    rows = [_row(temperature=1.0), _row(seed=42, temperature=1.0), _row(seed=7, temperature=0.7)]
    mixed = Sampler(seed=99).sample(torch.stack([logits[5], logits[0], logits[4]]), rows).tokens
    assert mixed[1] == alone[0]


def test_penalties_change_choice():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 1.0
    logits[0, 6] = 0.9
    s = Sampler()
    assert s.sample(logits, [_row(temperature=0.0)]).tokens == [4]
    assert s.sample(logits, [_row(temperature=0.0, frequency_penalty=0.5)]).tokens == [6]
    assert s.sample(logits, [_row(temperature=0.0, presence_penalty=0.5)]).tokens == [6]
    assert s.sample(logits, [_row(temperature=0.0, repetition_penalty=2.0)]).tokens == [6]


def test_top_logprobs_sorted_and_consistent():
    logits = torch.randn(1, 100)
    res = Sampler().sample(logits, [_row(temperature=0.0, logprobs=True, top_logprobs=20)])
    top = res.top_logprobs[0]
    assert len(top) == 20 and top[0][0] == res.tokens[0]
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert abs(top[0][1] - res.logprobs[0]) < 1e-6
    assert abs(top[0][1] - torch.log_softmax(logits, -1)[0].max().item()) < 1e-5
