"""``kvledger_cpu::quant_linear``: Q4_1 / Q8_0 blocks packed 16 rows at a time, int8 activations per
block of 32, integer dot products (VNNI, or the portable path).

Exactness: from the same quantized activations the kernel computes the float sum of
``d * sx * dot + m * xsum`` per block, so it equals a float64 reference of that sum within float32
rounding (rel 1e-5); a wrong byte in the layout is off by orders of magnitude. Against the float
product ``x @ W.T`` the int8 activations add ~0.5-1% relative error (as llama.cpp's Q8_1 does).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvledger import kernels
from kvledger.kernels.quant import S8_SEGMENT, dequantize, int8_linear, pack, q4_1, q8_0

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")


def quantized_acts(x: torch.Tensor):
    """The op's activation quantization in float32: codes, scale, and scale x the codes' sum per block
    of 32 (what the min term of Q4_1 multiplies)."""
    xf = x.float().view(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[..., None]).clamp(-127, 127)
    sx = amax / 127.0
    return q, sx, sx * q.sum(-1)


@pytest.mark.parametrize("bits", [4, 8])
def test_error_is_that_of_int8_activations_on_the_files_weights(bits):
    """Against the float product, the kernel is as close as the dequantized weights applied to the
    quantized activations (GGUF's Q8_1 scheme): the min term of Q4_1 must see the same quantized
    activations as the scale term, or the activations' rounding errors get weighted by d*q (all
    positive, ~8 d) instead of by the centred w; with the exact float sum there it was ~2.5x worse."""
    torch.manual_seed(7)
    w = torch.randn(64, 576) * 0.05
    x = torch.randn(16, 576)
    x[:, 5] *= 20  # an outlier channel, as real activations have
    wq = dequantize(w, bits).double()
    q, sx, _ = quantized_acts(x)
    emulated = (q * sx[..., None]).view(x.shape).double() @ wq.T
    exact = x.double() @ wq.T
    got = pack(w, bits)(x).double()
    err_kernel = ((got - exact).norm() / exact.norm()).item()
    err_q8 = ((emulated - exact).norm() / exact.norm()).item()
    assert err_kernel < 1.05 * err_q8, (err_kernel, err_q8)


def reference(x: torch.Tensor, w: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 of the kernel's sum, from the same codes and fp16 scales."""
    q, sx, xsum = (t.double() for t in quantized_acts(x))
    if bits == 4:
        c, d, m = (t.double() for t in q4_1(w))
        dot = torch.einsum("mgi,ngi->mng", q, c.view(w.shape[0], -1, 32))
        return (dot * d[None] * sx[:, None] + m[None] * xsum[:, None]).sum(-1)
    c, d = (t.double() for t in q8_0(w))
    dot = torch.einsum("mgi,ngi->mng", q, c.view(w.shape[0], -1, 32))
    return (dot * d[None] * sx[:, None]).sum(-1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])  # runs of 4 activation rows and their remainders
def test_equals_the_block_sums_exactly_up_to_float_rounding(bits, rows):
    torch.manual_seed(rows)
    w = torch.randn(48, 160) * 0.05
    x = torch.randn(rows, 160)
    got = pack(w, bits)(x)
    assert got.shape == (rows, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(x, w, bits), rtol=1e-5, atol=1e-5)
    # bf16 activations in, bf16 out: the same sums rounded once at the end
    xb = x.bfloat16()
    torch.testing.assert_close(pack(w, bits)(xb), pack(w, bits)(xb.float()).bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_close_to_the_float_product(bits):
    """Measured against x @ dequant(W).T on SmolLM2-sized layers: ~0.6% (int8), ~0.7-1.5% (int4)."""
    torch.manual_seed(0)
    for n, k in [(960, 576), (576, 1536)]:
        w = torch.randn(n, k) * 0.05
        p = pack(w, bits)
        for rows in (1, 4):
            x = torch.randn(rows, k)
            ref = x @ dequantize(w, bits).T
            rel = ((p(x) - ref).norm() / ref.norm()).item()
            assert rel < 0.03, (n, k, rows, rel)


def test_q4_1_and_q8_0_blocks_come_back_as_the_files_codes_and_scales():
    torch.manual_seed(2)
    n, k = 16, 64
    codes = torch.randint(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 maps a block's min to 0 and its max to 15
    d = (torch.rand(n, k // 32, 1) * 0.02 + 0.001).half().float()
    m = (torch.randn(n, k // 32, 1) * 0.05).half().float()
    q, d2, m2 = q4_1((d * codes + m).view(n, k))
    assert torch.equal(q.view(n, k // 32, 32), codes.to(torch.int32))
    assert torch.equal(d2, d[..., 0]) and torch.equal(m2, m[..., 0])
    c8 = torch.randint(-127, 128, (n, k // 32, 32))
    c8[..., 0] = 127
    q8, d8 = q8_0((d * c8).view(n, k))
    assert torch.equal(q8.view(n, k // 32, 32), c8.to(torch.int8)) and torch.equal(d8, d[..., 0])


def test_shapes_without_whole_blocks_are_not_packed_and_bad_arguments_are_refused():
    assert pack(torch.randn(40, 64), 4) is None  # 40 rows: not a multiple of 16
    assert pack(torch.randn(32, 48), 8) is None  # 48 inputs: not a multiple of 32
    p = pack(torch.randn(32, 64), 4)
    op = torch.ops.kvledger_cpu.quant_linear
    with pytest.raises(RuntimeError, match="do not match"):
        op(torch.randn(1, 96), p.w, p.scales, None, 4, 32)
    with pytest.raises(RuntimeError, match="wsum128"):
        p8 = pack(torch.randn(32, 64), 8)
        op(torch.randn(1, 64), p8.w, p8.scales, None, 8, 32)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(64, 2).t(), p.w, p.scales, None, 4, 32)
    assert op(torch.randn(0, 64), p.w, p.scales, None, 4, 32).shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 40])  # 40: not whole AVX-512 registers, the portable path
def test_quantize_rows_and_scale_rows_match_their_definitions(dtype, k):
    torch.manual_seed(6)
    x = (torch.randn(9, k) * torch.rand(9, 1) * 5).to(dtype)
    x[3] = 0  # an all-zero row: scale 0, every code 128
    xq, s = torch.ops.kvledger_cpu.quantize_rows(x)
    amax = x.float().abs().amax(1)
    # tensor / tensor: IEEE division (torch computes `127.0 / t` as a reciprocal times 127, an ulp off)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    assert torch.equal(s, amax / 127)
    assert torch.equal(xq, (torch.round(x.float() * inv[:, None]).clamp(-127, 127) + 128).to(torch.uint8))
    y, b = torch.randn(9, k), torch.randn(k).to(dtype)
    out = torch.ops.kvledger_cpu.scale_rows(y, s, b, x)
    assert out.dtype == dtype
    assert torch.equal(out, (y * s[:, None]).to(dtype) + b)  # rounded, then the bias added, as torch does
    assert torch.equal(torch.ops.kvledger_cpu.scale_rows(y, s, None, x), (y * s[:, None]).to(dtype))


def test_the_onednn_int8_route_is_exact_integer_arithmetic_with_per_token_scales():
    """u8 x s8 integer sums, then each channel's and each row's scale: equal to the float64 product of
    the codes (rel 1e-6); ~1% from the float product for rows of very different sizes."""
    torch.manual_seed(7)
    w = torch.randn(96, 160) * 0.05
    lin = int8_linear(w, "onednn")
    if lin is None:
        pytest.skip("this torch has no oneDNN int8 linear")
    x = torch.randn(12, 160) * torch.rand(12, 1) * 8
    y = lin(x)
    xq, s = torch.ops.kvledger_cpu.quantize_rows(x)
    wq = torch.round(w / lin.w_scale[:, None]).clamp(-127, 127)
    exact = ((xq.double() - 128) @ wq.double().T) * s.double()[:, None] * lin.w_scale.double()
    torch.testing.assert_close(y.double(), exact, rtol=1e-6, atol=1e-6)
    ref = x @ w.T
    assert ((y - ref).norm() / ref.norm()).item() < 0.02


def _vnni_linear(w: torch.Tensor):
    lin = int8_linear(w, "vnni")
    if lin is None:
        pytest.skip("kvledger's int8 kernel needs AVX512-VNNI")
    return lin


def segment_product(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The VNNI route's definition in float64: x's rows quantized per segment of S8_SEGMENT inputs (the
    last one shorter), each segment's integer sum with the weights' codes times its scale, times the
    channel's scale."""
    wq = torch.round(w / w_scale[:, None]).clamp(-127, 127).double()
    y = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for xs, ws in zip(x.float().split(S8_SEGMENT, 1), wq.split(S8_SEGMENT, 1)):
        amax = xs.abs().amax(1)
        # tensor / tensor: IEEE division, as the kernel (torch computes `127.0 / t` an ulp off)
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        codes = torch.round(xs * inv[:, None]).clamp(-127, 127).double()
        y += (codes @ ws.T) * (amax / 127).double()[:, None]
    return y * w_scale.double()


def test_the_vnni_int8_route_is_exact_integer_arithmetic_per_segment():
    """Each segment's integer sum exact, scaled by the segment's activation scale and the channel's:
    the float64 definition within float32 rounding (1e-6 of the largest output), around the kernel's
    tiles (rows 1, 3, 4, 5, 130 about its tiles of 4; outputs 16, 48, 80, 960 about its column tiles
    of 48) and K with a short last segment (36, 160) or none (576); zero inputs give zeros."""
    torch.manual_seed(3)
    for n, k in ((16, 36), (48, 160), (80, 576), (960, 576)):
        w = torch.randn(n, k) * 0.05
        lin = _vnni_linear(w)
        for m in (1, 3, 4, 5, 130):
            x = torch.randn(m, k) * torch.rand(m, 1) * 8
            x[0, : min(k, S8_SEGMENT)] = 0  # a segment of zeros: scale 0
            y = lin(x)
            assert y.dtype == torch.float32 and y.shape == (m, n)
            want = segment_product(x, w, lin.w_scale)
            # float32 sums of a few segments: within a few ulps of the row's largest output
            torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert torch.equal(lin(torch.zeros(2, 576)), torch.zeros(2, 960))


@pytest.mark.parametrize("rows", [3, 33])
def test_the_vnni_int8_route_in_bf16_is_its_float_result_rounded_then_the_bias_added(rows):
    """bf16 activations read as their float values, one rounding to bf16, then a bias added (rounded
    again), as torch adds a bias to a bf16 product."""
    torch.manual_seed(4)
    lin = _vnni_linear(torch.randn(80, 160) * 0.05)
    x = (torch.randn(rows, 160) * 4).bfloat16()
    b = (torch.randn(80) * 0.1).bfloat16()
    y32 = lin(x.float())
    assert torch.equal(lin(x), y32.bfloat16())
    assert torch.equal(lin(x, b), y32.bfloat16() + b)
    assert torch.equal(lin(x.float(), b.float()), (y32 + b.float()))


def test_segments_keep_the_channels_beside_a_large_one_precise():
    """Activations with a few channels ~50x the others (as in real models' hidden states): one scale per
    segment is more than twice as close to the float product as one per row (oneDNN's route)."""
    torch.manual_seed(5)
    w = torch.randn(64, 576) * 0.05
    x = torch.randn(16, 576)
    x[:, [7, 300]] *= 50
    lin = _vnni_linear(w)
    ref = x.double() @ w.double().T
    seg = ((lin(x).double() - ref).norm() / ref.norm()).item()
    amax = x.abs().amax(1, keepdim=True)
    wq = torch.round(w / lin.w_scale[:, None]).clamp(-127, 127) * lin.w_scale[:, None]
    per_row = torch.round(x * 127 / amax) * amax / 127 @ wq.T
    row = ((per_row.double() - ref).norm() / ref.norm()).item()
    assert seg < 0.5 * row, (seg, row)


def test_the_vnni_int8_route_refuses_what_does_not_match():
    lin = _vnni_linear(torch.randn(32, 160))
    op = torch.ops.kvledger_cpu.int8_linear
    with pytest.raises(RuntimeError, match="woff"):
        op(torch.randn(2, 160), lin.w, lin.w_scale, lin.woff[:2], None)  # 2 segments' offsets, 3 needed
    with pytest.raises(RuntimeError, match="do not match"):
        op(torch.randn(2, 128), lin.w, lin.w_scale, lin.woff[:2], None)
    assert op(torch.randn(0, 160), lin.w, lin.w_scale, lin.woff, None).shape == (0, 32)


def test_the_int8_route_by_cpu():
    """kvledger's kernel where the CPU has VNNI and no AMX (oneDNN's int8 GEMM runs on the tiles), for
    the shapes it takes."""
    lin = int8_linear(torch.randn(32, 64))
    if lin is None:
        pytest.skip("no int8 route here")
    want = kernels.quant_isa() == "avx512-vnni" and not kernels.has_amx()
    assert lin.vnni == want
    assert lin(torch.randn(5, 64).bfloat16()).shape == (5, 32)
    odd = int8_linear(torch.randn(24, 64))  # not whole blocks of 16 outputs: oneDNN's route
    assert odd is None or not odd.vnni
    if odd is not None:
        assert odd(torch.randn(3, 64)).shape == (3, 24)


@pytest.mark.skipif(
    kernels.quant_isa() != "avx512-vnni", reason="no AVX512-VNNI: only the portable path runs"
)
def test_the_portable_path_is_bit_identical(tmp_path):
    """Both builds sum in the same order with the same fused multiply-adds, and quantize rows the
    same way (round half to even)."""
    torch.manual_seed(5)
    cases = [
        (torch.randn(64, 128) * 0.05, torch.randn(r, 128).bfloat16(), b) for b in (4, 8) for r in (1, 3, 6)
    ]
    torch.save(cases, tmp_path / "cases.pt")
    code = (
        "import torch, sys; from kvledger import kernels; from kvledger.kernels.quant import pack;"
        "assert kernels.load() and kernels.quant_isa() == 'scalar';"
        f"cases = torch.load({str(tmp_path / 'cases.pt')!r});"
        "q = torch.ops.kvledger_cpu.quantize_rows;"
        f"torch.save([(pack(w, b)(x), *q(x)) for w, x, b in cases], {str(tmp_path / 'out.pt')!r})"
    )
    env = {**os.environ, "KVLEDGER_CPU_ISA": "scalar"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for (w, x, b), (y, xq, s) in zip(cases, torch.load(tmp_path / "out.pt")):
        assert torch.equal(pack(w, b)(x), y)
        xq2, s2 = torch.ops.kvledger_cpu.quantize_rows(x)
        assert torch.equal(xq, xq2) and torch.equal(s, s2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_argmax_is_the_argmax_of_the_heads_logits(bits, dtype):
    """``head_argmax`` (the LM head's greedy token, the vocabulary in chunks of 4,096 outputs): the
    index ``max(dim).indices`` picks on ``quant_linear``'s logits, the first of equal maxima, over the
    ``valid`` first outputs only (a head padded past the vocabulary)."""
    torch.manual_seed(3)
    n, k = 9008, 64  # three chunks, the last partial
    q = pack(torch.randn(n, k), bits)
    x = torch.randn(5, k).to(dtype)
    logits = q(x)
    for valid in (n, 8195, 17):
        got = torch.ops.kvledger_cpu.head_argmax(x, q.w, q.scales, q.wsum128, bits, n, valid)
        assert torch.equal(got, logits[:, :valid].float().max(dim=-1).indices)
    # ties: a row whose best output appears twice (two equal weight rows) takes the first
    w = torch.randn(n, k)
    w[7000] = w[123] = 4 * w[:, :].abs().max(0).values
    q = pack(w, bits)
    x = torch.rand(2, k).to(dtype) + 0.5
    got = torch.ops.kvledger_cpu.head_argmax(x, q.w, q.scales, q.wsum128, bits, n, n)
    assert got.tolist() == [123, 123] == q(x).float().max(dim=-1).indices.tolist()
