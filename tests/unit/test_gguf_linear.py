"""``kvledger_cpu::gguf_linear``: a GGUF file's blocks read as stored (``csrc/gguf_blocks.h``), per kind,
against ``gguf.quants.dequantize`` then a float64 matmul.

The bound. The kernel quantizes each group of 32 activations to ``sx * xq`` (``sx = max|x| / 127``,
round to nearest), so each element is off by at most ``sx / 2``; everything after is exact integer
dots and float32 sums. Hence, per output,

    |y - x @ W.T| <= A + F,   A = sum_g (sx_g / 2) * sum_{k in g} |W[n, k]|,
                              F = (K / 64 + K / 512 + 8) * 2**-24 * sum_k |W[n, k]| * (|x_k| + sx_g / 2)

``A`` is the activations' rounding (it dominates: about 1% of the output's scale); ``F`` covers the
float32 sums (one fused multiply-add a lane per 64 inputs, the mins' 16 lanes, the final tree, the
product of the two scales) and gguf's own float32 rounding of ``d * sc * q``. ``A`` is a worst case
(10-35% of the mean |y| on these shapes); the errors seen are 0.4-2.5% of it, so the tests also hold the
mean error under 5% of the mean |y|: a wrong byte, nibble or scale puts errors of the output's own size
on most rows.

The VNNI and the portable builds sum in the same order with the same fused multiply-adds: equal bit
for bit (``test_the_portable_path_is_bit_identical``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from kvledger import kernels

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")

# kind: (elements a block, bytes a block, [(byte offset of an fp16 scale, its range)])
KINDS = {
    "Q4_0": (32, 18, [(0, 1.0)]),
    "Q4_1": (32, 20, [(0, 1.0), (2, 8.0)]),
    "Q5_0": (32, 22, [(0, 1.0)]),
    "Q5_1": (32, 24, [(0, 0.5), (2, 8.0)]),
    "Q8_0": (32, 34, [(0, 0.1)]),
    "IQ4_NL": (32, 18, [(0, 0.1)]),
    "Q4_K": (256, 144, [(0, 0.03), (2, 0.1)]),
    "Q5_K": (256, 176, [(0, 0.015), (2, 0.1)]),
    "Q6_K": (256, 210, [(208, 0.03)]),
}


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, k / block * bytes]`` uint8: random codes, sub-block scales and mins (every byte pattern is
    a valid code or 6-bit / int8 scale), with finite fp16 super-scales of either sign."""
    block, nbytes, scales = KINDS[kind]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for off, rng_max in scales:
        d = (rng.uniform(-rng_max, rng_max, size=(n, k // block)) / 64).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def dequantized(kind: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float64))


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``A + F`` of the module docstring, ``[M, N]`` float64."""
    m, k = x.shape
    xg = x.double().view(m, -1, 32)
    half = (xg.abs().amax(-1) / 127 / 2)  # [M, G]: sx / 2
    wa = w.abs().view(w.shape[0], -1, 32)  # [N, G, 32]
    a = half @ wa.sum(-1).T
    f = (k / 64 + k / 512 + 8) * 2.0**-24 * ((xg.abs() + half[..., None]).view(m, k) @ w.abs().T)
    return a + f


def run(kind: str, raw: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    k = x.shape[1]
    return torch.ops.kvledger_cpu.gguf_linear(x, torch.from_numpy(raw), int(gguf.GGMLQuantizationType[kind]), n, k)


def shapes(kind: str) -> list[tuple[int, int]]:
    """(N, K): N not a multiple of 16; K an odd number of 32-groups (the padded tail) and a longer one."""
    return [(40, 768), (23, 256)] if KINDS[kind][0] == 256 else [(40, 96), (23, 544)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_equals_dequantize_then_matmul_within_the_bound(kind):
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    for n, k in shapes(kind):
        raw = random_blocks(kind, n, k, rng)
        w = dequantized(kind, raw)
        assert torch.isfinite(w).all()
        for m in (1, 3, 17, 33):
            x = torch.randn(m, k)
            x[:, :5] *= 20  # a few large channels, as real activations have
            y = run(kind, raw, x).double()
            ref = x.double() @ w.T
            err, lim = (y - ref).abs(), bound(x, w)
            assert (err <= lim).all(), (kind, n, k, m, (err / lim).max().item())
            # The bound is a worst case (10-35% of the mean |y| here); the typical error is ~1%, and a
            # wrong byte, nibble or scale is of the output's own size.
            assert err.mean() < 0.05 * ref.abs().mean(), (kind, n, k, m)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_bf16_activations_and_output(kind):
    """bf16 x: quantized from its own values; y rounded once to bf16 (2**-8 relative more)."""
    rng = np.random.default_rng(3)
    n, k = shapes(kind)[0]
    raw = random_blocks(kind, n, k, rng)
    w = dequantized(kind, raw)
    x = torch.randn(5, k).bfloat16()
    y = run(kind, raw, x)
    assert y.dtype == torch.bfloat16
    ref = x.double() @ w.T
    assert ((y.double() - ref).abs() <= bound(x.float(), w) * (1 + 2**-8) + ref.abs() * 2**-8).all()


def test_rejects_blocks_that_do_not_match():
    raw = random_blocks("Q4_K", 4, 256, np.random.default_rng(0))
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="blocks do not match"):
        torch.ops.kvledger_cpu.gguf_linear(x, torch.from_numpy(raw), 12, 5, 256)
    with pytest.raises(RuntimeError, match="no kernel"):
        torch.ops.kvledger_cpu.gguf_linear(x, torch.from_numpy(raw), 16, 4, 256)  # IQ2_XXS


@pytest.mark.skipif(kernels.quant_isa() != "avx512-vnni", reason="no AVX512-VNNI: only the portable path runs")
def test_the_portable_path_is_bit_identical(tmp_path):
    rng = np.random.default_rng(11)
    torch.manual_seed(11)
    cases = []
    for kind in KINDS:
        for n, k in shapes(kind):
            raw = random_blocks(kind, n, k, rng)
            for m in (1, 9):
                cases.append((kind, torch.from_numpy(raw), torch.randn(m, k)))
    kind, w, x = cases[-1]
    cases.append((kind, w, torch.randn(3, x.shape[1]).bfloat16()))
    torch.save(cases, tmp_path / "cases.pt")
    code = (
        "import torch, gguf; from kvledger import kernels;"
        "assert kernels.load() and kernels.quant_isa() == 'scalar';"
        f"cases = torch.load({str(tmp_path / 'cases.pt')!r});"
        "f = lambda kind, w, x: torch.ops.kvledger_cpu.gguf_linear("
        "x, w, int(gguf.GGMLQuantizationType[kind]), w.shape[0], x.shape[1]);"
        f"torch.save([f(*c) for c in cases], {str(tmp_path / 'out.pt')!r})"
    )
    env = {**os.environ, "KVLEDGER_CPU_ISA": "scalar"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for (kind, w, x), y in zip(cases, torch.load(tmp_path / "out.pt")):
        assert torch.equal(run(kind, w.numpy(), x), y), kind


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0", "Q4_K"])
def test_head_argmax_on_blocks_as_stored(kind):
    """A head the file keeps in its own kind (Q4_K_M files put ``output.weight`` in Q6_K): ``head_argmax``
    picks what ``max(dim).indices`` picks on ``gguf_linear``'s logits, over the first ``valid`` outputs,
    the vocabulary in chunks of 4,096 (three here, the last partial; n not a multiple of 16)."""
    rng = np.random.default_rng(5)
    n, k = 9003, 256
    raw = random_blocks(kind, n, k, rng)
    w = torch.from_numpy(raw)
    kid = int(gguf.GGMLQuantizationType[kind])
    empty = torch.empty(0, 2, dtype=torch.int64)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, k).to(dtype)
        logits = run(kind, raw, x).float()
        for valid in (n, 8195, 17):
            got = torch.ops.kvledger_cpu.head_argmax(x, w, empty, None, -kid, n, valid)
            assert torch.equal(got, logits[:, :valid].max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="GGUF blocks do not match"):
        torch.ops.kvledger_cpu.head_argmax(x, w[:-1], empty, None, -kid, n, n)
