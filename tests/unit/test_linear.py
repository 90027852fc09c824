"""Weight-only int8 linear layers: the int8 copy is used for few rows, bf16 beyond, both close."""

from __future__ import annotations

import pytest
import torch

from kvledger import Engine
from kvledger.errors import ValidationError
from kvledger.model.linear import Linear, quantize_int8


def test_quantize_int8_roundtrip_error_is_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 32])
def test_int8_linear_close_to_bf16_and_switches_by_rows(rows, monkeypatch):
    torch.manual_seed(1)
    w = torch.randn(96, 64).bfloat16()
    b = torch.randn(96).bfloat16()
    lin = Linear(w, b, "int8", int8_max_rows=4)
    calls = []
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, 64).bfloat16()
    y = lin(x)
    ref = x.float() @ w.float().T + b.float()
    assert bool(calls) == (rows <= 4)
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 0.02, rel


def test_int8_needs_bfloat16(tiny_llama):
    with pytest.raises(ValueError):
        Linear(torch.randn(8, 8), None, "int8")
    with pytest.raises(ValidationError):
        Engine(tiny_llama, dtype="float32", quantization="int8", max_total_tokens=256)


def test_int8_engine_close_to_fp32(tiny_llama):
    """Short prompts (<= 4 tokens) run every linear layer on the int8 copy; the chosen token's
    logprob stays within the same bound as plain bf16 (test_bf16_close_to_fp32)."""
    eng32 = Engine(tiny_llama, dtype="float32", max_total_tokens=1024)
    eng8 = Engine(
        tiny_llama, dtype="bfloat16", quantization="int8", max_total_tokens=1024, strict_memory=True
    )
    assert eng8.core.info.dtype == "bfloat16+int8"
    p = {"max_new_tokens": 1, "temperature": 0, "logprobs": True}
    for prompt in ([5], [7, 9, 11], [100, 3, 4, 200]):
        a = eng32.generate(input_ids=prompt, sampling_params=p)["meta_info"]["output_token_logprobs"][0]
        b = eng8.generate(input_ids=prompt, sampling_params=p)["meta_info"]["output_token_logprobs"][0]
        assert a[1] == b[1]
        assert abs(a[0] - b[0]) < 0.1
    out = eng8.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 24, "temperature": 0})
    assert len(out["output_ids"]) >= 1
    eng8.audit()
