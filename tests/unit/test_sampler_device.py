"""The device sampler (batched, on the logits' device) against the host sampler, here on CPU
tensors: the same tokens for greedy and seeded rows over random batches of every kind of row
(temperature, top-k/p, min-p, penalties, bitmasks, a request's draft-verify rows), the same logprobs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvledger.common.sampling import SamplingParams, SamplingRow
from kvledger.constrained.bitmask import bitmask_width
from kvledger.engine.runner import _verify_rows
from kvledger.model import DeviceSampler, Sampler
from kvledger.model.seeded import inverse_cdf, seeded_uniform
from kvledger.scheduler.output import ScheduledReq

V = 300


def _params(rng: random.Random) -> SamplingParams:
    kw: dict = {"seed": rng.randrange(2**63) if rng.random() < 0.9 else rng.randrange(10)}
    kind = rng.choice(["greedy", "temp", "top_k", "top_p", "min_p", "all"])
    kw["temperature"] = 0.0 if kind == "greedy" else rng.choice([0.3, 0.7, 1.0, 1.5])
    if kind in ("top_k", "all"):
        kw["top_k"] = rng.choice([1, 5, 40, V + 7])
    if kind in ("top_p", "all"):
        kw["top_p"] = rng.choice([0.5, 0.9, 0.99])
    if kind in ("min_p", "all"):
        kw["min_p"] = rng.choice([0.01, 0.1, 0.5])
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([0.8, 1.3])
    if rng.random() < 0.4:
        kw["frequency_penalty"] = rng.choice([-0.5, 0.4, 1.0])
    if rng.random() < 0.4:
        kw["presence_penalty"] = rng.choice([-0.3, 0.6])
    if rng.random() < 0.4:
        kw["logprobs"] = True
        kw["top_logprobs"] = rng.choice([0, 1, 5])
    return SamplingParams(**kw)


def _batch(rng: random.Random):
    """Rows as the runner builds them (a request with drafts gives 1 + num_draft verify rows), their
    logits, and bitmasks over some requests' rows."""
    rows: list[SamplingRow] = []
    masks, masked = [], []
    for _ in range(rng.randint(1, 6)):
        p = _params(rng)
        hist = [rng.randrange(V) for _ in range(rng.randint(0, 12))] if p.has_penalties else None
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 8))] if p.has_penalties else None
        s = SamplingRow(p, rng.randint(0, 50), prompt, hist)
        nd = rng.choice([0, 0, 1, 3])
        drafts = [rng.randrange(V) for _ in range(nd)]
        req = ScheduledReq(rid="r", slot=0, start=0, token_ids=[1, *drafts], sampling=s, num_draft=nd)
        verify = _verify_rows(req)
        if rng.random() < 0.3:
            words = np.frombuffer(rng.randbytes(4 * bitmask_width(V) * len(verify)), dtype=np.int32)
            masks.append(words.reshape(len(verify), -1))
            masked.extend(range(len(rows), len(rows) + len(verify)))
        rows.extend(verify)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 3
    mask = (np.concatenate(masks), masked) if masks else None
    return logits, rows, mask


@pytest.mark.parametrize("case", range(60))
def test_device_sampler_equals_host(case):
    rng = random.Random(case)
    logits, rows, mask = _batch(rng)
    host = Sampler(seed=5).sample(logits.clone(), rows, mask)
    dev = DeviceSampler(seed=5).sample(logits.clone(), rows, mask)
    assert dev.tokens == host.tokens
    assert dev.logprobs == host.logprobs
    assert dev.top_logprobs == host.top_logprobs


def test_seeded_draw_is_a_function_of_seed_and_position():
    seeds = torch.tensor([0, 1, 2**63 - 1, 1234, 1234])
    pos = torch.tensor([0, 0, 7, 3, 4])
    u = seeded_uniform(seeds, pos)
    assert torch.equal(u, seeded_uniform(seeds.flip(0), pos.flip(0)).flip(0))
    assert ((u >= 0) & (u < 1)).all() and len(set(u.tolist())) == 5
    # Roughly uniform, and the inverse CDF follows the probabilities.
    many = seeded_uniform(torch.full((4000,), 99), torch.arange(4000))
    assert abs(many.mean().item() - 0.5) < 0.02
    probs = torch.tensor([[0.0, 0.7, 0.2, 0.1]]).expand(4000, 4)
    tok = inverse_cdf(probs, many)
    freq = torch.bincount(tok, minlength=4).float() / 4000
    assert freq[0] == 0 and abs(freq[1] - 0.7) < 0.03 and abs(freq[2] - 0.2) < 0.03


def test_unseeded_rows_draw_from_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 0.0]])).expand(3000, 4).contiguous()
    rows = [SamplingRow(SamplingParams(temperature=1.0), 0) for _ in range(3000)]
    tok = torch.tensor(DeviceSampler(seed=3).sample(logits, rows).tokens)
    freq = torch.bincount(tok, minlength=4).float() / 3000
    assert freq[3] == 0 and abs(freq[0] - 0.6) < 0.04 and abs(freq[1] - 0.3) < 0.04


def test_every_op_stays_on_the_logits_device():
    """On ``meta`` (no GPU here): a host tensor mixed into the device path raises, as on a GPU. Every
    kind of row at once: greedy, unseeded, seeded, top-k/p, min-p, penalties, a bitmask, logprobs."""
    hist = dict(prompt_ids=[1, 2, 3], output_ids=[4, 4, 5])
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0, **hist),
        SamplingRow(SamplingParams(temperature=0.8, top_k=7, frequency_penalty=0.5), 1, **hist),
        SamplingRow(SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1, seed=3, presence_penalty=0.2), 2, **hist),
        SamplingRow(SamplingParams(temperature=1.0, seed=4, logprobs=True, top_logprobs=5), 3),
    ]
    mask = (np.full((2, bitmask_width(V)), -1, dtype=np.int32), [1, 2])
    packed, k = DeviceSampler().draw(torch.empty(len(rows), V, device="meta"), rows, mask)
    assert packed.device.type == "meta" and packed.shape == (len(rows), 2 + 2 * k) and k == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("case", range(20))
def test_cuda_device_sampler_equals_host(case):
    """On a GPU: the device sampler's tokens from CUDA logits equal the host sampler's from the same
    logits on the CPU (greedy and seeded rows; float rounding may differ, draws at a boundary
    within ~1e-7 of the mass would too: none in these cases)."""
    logits, rows, mask = _batch(random.Random(case))
    host = Sampler().sample(logits, rows, mask)
    dev = DeviceSampler().sample(logits.cuda(), rows, mask)
    assert dev.tokens == host.tokens
    for a, b in zip(dev.logprobs, host.logprobs):
        assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-4)


@pytest.mark.parametrize("backend", [Sampler, DeviceSampler])
def test_a_masked_row_never_draws_a_disallowed_token(backend):
    """The grammar mask comes before the draw on both backends: over many seeded and unseeded draws
    at high temperature (where most of the mass sits on disallowed tokens), with sparse masks whose
    few allowed tokens include some of the lowest logits, every drawn token has its bit set."""
    rng = np.random.default_rng(0)
    n = 400
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(1)) * 4
    words = np.zeros((n, bitmask_width(V)), dtype=np.int32)
    allowed = [rng.choice(V, size=rng.integers(1, 4), replace=False) for _ in range(n)]
    for i, toks in enumerate(allowed):
        for t in toks:
            words[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    rows = [
        SamplingRow(SamplingParams(temperature=2.0, seed=i if i % 2 else None, top_p=0.9 if i % 3 else 1.0), i)
        for i in range(n)
    ]
    tokens = backend(seed=1).sample(logits, rows, (words, list(range(n)))).tokens
    assert all(t in set(a.tolist()) for t, a in zip(tokens, allowed))
