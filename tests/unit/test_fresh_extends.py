"""New prompts' attention (extends without a cached prefix) runs over their own K/V, several prompts
to one SDPA call: equal prompts side by side as views, lengths within ``FRESH_PAD`` of each other
padded together, the rest alone; every row equal to one call per prompt over the pool's K/V."""

from __future__ import annotations

import pytest
import torch

from kvledger.model.attention_extend import attend_extends


def _case(lengths: list[int], dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    heads, kvh, d = 6, 2, 32
    t = sum(lengths)
    q = torch.randn(t, heads, d).to(dtype)
    k, v = torch.randn(t, kvh, d).to(dtype), torch.randn(t, kvh, d).to(dtype)
    locs = torch.randperm(4 * t)[:t]  # where the pool holds each token's K/V
    k_cache = torch.zeros(kvh, 4 * t, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, locs], v_cache[:, locs] = k.transpose(0, 1), v.transpose(0, 1)
    ext, start = [], 0
    for n in lengths:
        ext.append((start, n, locs[start : start + n], None))
        start += n
    return d**-0.5, q, k, v, k_cache, v_cache, ext


@pytest.mark.parametrize(
    "lengths",
    [
        [128] * 6,  # equal, side by side: one call over views
        [40, 37, 33, 128, 120, 5, 64],  # three padded groups and two alone
        [17],
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompts_together_equal_one_call_each_over_the_pool(lengths, dtype, monkeypatch):
    scale, q, k, v, k_cache, v_cache, ext = _case(lengths, dtype)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **kw):
        calls.append(a[0].shape[0])  # prompts in the call
        return real(*a, **kw)

    want = torch.empty_like(q)
    attend_extends(want, q, k_cache, v_cache, ext, scale)  # no k/v: one call per prompt, gathered from the pool
    got = torch.empty_like(q)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    attend_extends(got, q, k_cache, v_cache, ext, scale, k, v)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert calls == [1] * len(lengths)  # the reference path keeps transformers' shapes
    elif lengths == [128] * 6:
        assert calls == [6]
    elif len(lengths) == 7:
        assert sorted(calls) == [1, 1, 2, 3]  # 128+120 and 40+37+33 (within 1.25x); 64 and 5 alone
