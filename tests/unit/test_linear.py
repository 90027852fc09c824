"""Weight-only int8/int4 linear layers: kvledger's kernel for every row count where it loads, torch's
weight-only kernels for few rows and bf16 beyond otherwise; all close to the float product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvledger import Engine, kernels
from kvledger.errors import ValidationError
from kvledger.model import linear
from kvledger.model.linear import (
    INT8_BATCH_ROWS,
    INT8_VNNI_ROWS,
    Linear,
    can_prepack,
    quantize_int4,
    quantize_int8,
)


def test_quantize_int8_roundtrip_error_is_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()


def test_int4_recovers_q4_1_blocks_exactly():
    """Weights dequantized from Q4_1 (d*q + m per block of 32, codes 0..15 with 0 and 15 used) come
    back as the same codes, scales and zeros."""
    torch.manual_seed(2)
    n, k = 16, 64
    codes = torch.randint(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 maps a block's min to 0 and max to 15
    d = torch.rand(n, k // 32, 1) * 0.02 + 0.001
    m = torch.randn(n, k // 32, 1) * 0.05
    w = (d * codes + m).view(n, k)
    q, scale, zero = quantize_int4(w)
    assert torch.equal(q.view(n, k // 32, 32), codes.to(torch.int32))
    torch.testing.assert_close(scale, d[..., 0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(zero, (m + 8 * d)[..., 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 32])
def test_quantized_linear_close_to_bf16_and_switches_by_rows(mode, rows, path, monkeypatch):
    """Both quantized paths. With kvledger's kernels and ``int8_batch``: calls below
    ``INT8_BATCH_ROWS`` / ``INT8_VNNI_ROWS`` (oneDNN's / kvledger's int8 route; both lowered to 5 here)
    take the kernel, larger ones the int8 linear (per-token int8 activations); without them (torch's kernels): at most 4 rows the quantized copy, larger ones the
    dense bf16 weight (exactly F.linear's)."""
    if path == "kernel" and not kernels.load():
        pytest.skip(f"CPU kernels unavailable: {kernels.status()}")
    if path == "torch":
        monkeypatch.setattr(kernels, "load", lambda: False)
    torch.manual_seed(1)
    w = torch.randn(96, 64).bfloat16()
    b = torch.randn(96).bfloat16()
    monkeypatch.setattr(linear, "INT8_BATCH_ROWS", 5)
    monkeypatch.setattr(linear, "INT8_VNNI_ROWS", 5)
    lin = Linear(w, b, mode, small_rows=4, int8_batch=True)
    assert (lin.qw is not None) == (lin.w8 is not None) == (path == "kernel")
    assert Linear(w, b, mode, small_rows=4).w8 is None  # off unless asked
    x = torch.randn(rows, 64).bfloat16()
    y = lin(x)
    dense = F.linear(x, w, b)
    assert torch.equal(y, dense) == (rows > 4 and path == "torch")
    if path == "kernel" and rows > 4:
        assert torch.equal(y, lin.w8(x, b))
    ref = x.float() @ w.float().T + b.float()
    rel = (y.float() - ref).norm() / ref.norm()
    # int4 of random (non-Q4_1) weights is lossy: ~1/30 of a group's range per weight; the int8
    # linear's per-token activations ~1%
    assert rel < (0.03 if mode == "int8" or rows > 4 else 0.08), rel


@pytest.mark.parametrize(
    "rows", [1, INT8_VNNI_ROWS - 1, INT8_VNNI_ROWS, 64, INT8_BATCH_ROWS - 1, INT8_BATCH_ROWS, 300]
)
def test_int8_batch_takes_calls_from_its_routes_threshold(rows):
    """``int8_batch`` without thresholds of its own: the int8 linear from INT8_VNNI_ROWS rows on
    kvledger's VNNI kernel (batched decodes too), from INT8_BATCH_ROWS on oneDNN's (prefill chunks),
    where each is the faster one; kvledger's int4 kernel below, bit for bit each path's own output."""
    if not kernels.load():
        pytest.skip(f"CPU kernels unavailable: {kernels.status()}")
    torch.manual_seed(5)
    w = torch.randn(96, 64).bfloat16()
    lin = Linear(w, None, "int4", int8_batch=True)
    if lin.w8 is None:
        pytest.skip("no int8 route here")
    x = torch.randn(rows, 64).bfloat16()
    want = lin.w8(x, None) if rows >= (INT8_VNNI_ROWS if lin.w8.vnni else INT8_BATCH_ROWS) else lin.qw(x)
    assert torch.equal(lin(x), want)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_the_kernel_serves_every_row_count(mode, rows):
    """Without --enable-int8-batch, kvledger's kernel runs prefill-sized calls too (not the bf16
    GEMM): the output is the kernel's, bit for bit, and not the dense product's."""
    if not kernels.load():
        pytest.skip(f"CPU kernels unavailable: {kernels.status()}")
    torch.manual_seed(3)
    w, b = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    lin = Linear(w, b, mode, small_rows=4)
    x = torch.randn(rows, 64).bfloat16()
    y = lin(x)
    assert torch.equal(y, lin.qw(x) + b)
    assert not torch.equal(y, F.linear(x, w, b))


def test_int8_needs_bfloat16(tiny_llama):
    with pytest.raises(ValueError):
        Linear(torch.randn(8, 8), None, "int8")
    with pytest.raises(ValidationError):
        Engine(tiny_llama, dtype="float32", quantization="int8", max_total_tokens=256)


def test_quantization_with_dtype_auto_is_bfloat16(tiny_llama):
    """`--quantization int4` with the default `--dtype auto` starts (auto means bf16 then)."""
    eng = Engine(tiny_llama, quantization="int4", max_total_tokens=256)
    assert eng.core.info.dtype == "bfloat16+int4"


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_close_to_fp32(tiny_llama, mode):
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
    assert eng8.audit().ok, eng8.audit().describe()


@pytest.mark.skipif(not can_prepack(torch.empty(1, dtype=torch.bfloat16)), reason="oneDNN without bf16 here")
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 300])
def test_prepacked_bf16_linear_is_bit_identical_to_f_linear(rows):
    """The oneDNN-prepacked weight gives exactly F.linear's result at any row count (the layout is
    chosen for 32 rows) and replaces the dense copy; unpack brings the same weight back."""
    torch.manual_seed(3)
    w, b = torch.randn(80, 64).bfloat16(), torch.randn(80).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    lin = Linear(w.clone(), b.clone())
    assert lin.packed is not None and lin.w is None and lin.packed_bytes() == w.numel() * 2
    assert torch.equal(lin(x), F.linear(x, w, b))
    lin.unpack()
    assert lin.packed is None and torch.equal(lin.w, w) and torch.equal(lin(x), F.linear(x, w, b))
    fp32 = Linear(w.float())
    assert fp32.packed is None  # the fp32 reference path stays F.linear


@pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")
def test_packed_weights_move_into_one_allocation_and_compute_the_same():
    """``place_packed_weights``: every packed tensor (the int4 and int8 codes, scales, sums; the VNNI
    int8 copy's) becomes a view of one allocation, holding the same values; outputs are unchanged
    bit for bit, at decode and prefill row counts; a tensor shared by two layers moves once."""
    torch.manual_seed(4)
    layers = nn.ModuleList(
        [Linear(torch.randn(96, 64).bfloat16(), None, mode, int8_batch=True) for mode in ("int4", "int8")]
    )
    layers.append(nn.Module())
    layers[2].tied = layers[0].qw  # the same PackedWeight under another module (tied embeddings)
    xs = [torch.randn(r, 64).bfloat16() for r in (1, 32, INT8_BATCH_ROWS + 3)]
    before = [[lin(x) for x in xs] for lin in layers[:2]]
    old = [t.clone() for lin in layers[:2] for t in (lin.qw.w, lin.qw.scales)]
    moved = linear.place_packed_weights(layers)
    tensors = [t for lin in layers[:2] for t in (lin.qw.w, lin.qw.scales)]
    assert moved >= sum(t.numel() * t.element_size() for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(torch.equal(a, b) for a, b in zip(tensors, old))
    assert layers[2].tied is layers[0].qw
    for lin, want in zip(layers[:2], before):
        assert all(torch.equal(lin(x), y) for x, y in zip(xs, want))
    assert linear.place_packed_weights(nn.ModuleList([nn.Linear(4, 4)])) == 0  # nothing packed: nothing moved
