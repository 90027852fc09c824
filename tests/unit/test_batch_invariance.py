"""Each kernel of a forward gives a row the same bits whatever else is in the call (issue 56): the row
computed alone equals it computed among 1..64 rows, in the default kernels and in those that
``--enable-deterministic-inference`` routes every call to (docs/architecture.md, "Reduction orders").

Attention: the decode kernel (split over threads at fixed 64-key chunks, never by the thread count or
the batch), the per-token extend kernel and the flash kernel's vdpbf16ps form give one query over
the same keys the same bits, on 1 and 2 threads. The AMX paths (the quantized kernel's tiles from
``AMX_TILE_ROWS`` rows, the flash kernel's AMX form) and ``--enable-int8-batch`` sum otherwise by
design; deterministic inference keeps calls off them (tests/engine/test_determinism.py)."""

from __future__ import annotations

import pytest
import torch

from kvledger import kernels
from kvledger.kernels.quant import pack
from kvledger.model.layers.norm import rms_norm
from tests.unit.test_cpu_kernels import _pool, _table

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")
ops = torch.ops.kvledger_cpu if kernels.load() else None
ROWS = range(1, 65)


def _row_invariant(f, x: torch.Tensor) -> None:
    """``f`` of the first m rows of ``x`` equals the first m rows of ``f(x)``, and each row alone its row,
    bit for bit, for m in 1..64."""
    full = f(x)
    for m in ROWS:
        assert torch.equal(f(x[:m].contiguous()), full[:m]), f"{m} rows"
    for i in range(x.shape[0]):
        assert torch.equal(f(x[i : i + 1].contiguous())[0], full[i]), f"row {i} alone"


@pytest.mark.parametrize("bits", [4, 8])
def test_the_quantized_kernel_gives_a_row_the_same_bits_at_every_row_count(bits):
    """kvledger's int4/int8 kernel (the default for a quantized model below the AMX thresholds, and
    for every call under deterministic inference): activations quantized per row and group, integer
    dot products, each row's groups summed in one order whether its tile holds 1 or 4 rows or its row
    block is paired."""
    torch.manual_seed(0)
    w = pack(torch.randn(96, 576) * 0.05, bits)
    x = (torch.randn(64, 576) * 2).bfloat16()
    _row_invariant(w, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k", "n", "bias"), [(576, 96, True), (50, 37, False)])
def test_the_dense_kernel_gives_a_row_the_same_bits_at_every_row_count(dtype, k, n, bias):
    """Unquantized layers under deterministic inference: one chain of fused multiply-adds per lane and one
    tree per output; close to the float product (its only rounding is the output's and the sums')."""
    torch.manual_seed(1)
    x, w = torch.randn(64, k).to(dtype), torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    _row_invariant(lambda t: ops.dense_linear(t, w, b), x)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(ops.dense_linear(x, w, b).float(), ref, rtol=2**-7 if dtype != torch.float32 else 1e-5,
                               atol=1e-3 if dtype == torch.float32 else 0.3)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_elementwise_and_norm_kernels_and_the_final_norm_are_per_row(dtype):
    """RMSNorm (fused add too), SiLU-and-multiply and rotary are per-row kernels; the final norm
    (torch's ops) and the sampler's log-softmax reduce each row alone too."""
    torch.manual_seed(2)
    x, res, w = (torch.randn(64, 576) * 3).to(dtype), torch.randn(64, 576).to(dtype), torch.randn(576).to(dtype)
    _row_invariant(lambda t: ops.rms_norm(t, w, 1e-5), x)
    # (each row with its own residual: the two side by side in one row)
    _row_invariant(lambda t: ops.add_rms_norm(t[:, 576:].clone(), t[:, :576].contiguous(), w, 1e-5), torch.cat((x, res), 1))
    _row_invariant(lambda t: rms_norm(t, w, 1e-5), x)
    _row_invariant(lambda t: ops.silu_mul(t), torch.randn(64, 2 * 1536).to(dtype))
    logits = torch.randn(64, 49152) * 5
    _row_invariant(lambda t: torch.log_softmax(t, dim=-1), logits)
    cos, sin = torch.randn(300, 32).to(dtype), torch.randn(300, 32).to(dtype)
    qk = torch.randn(64, 12 * 64 + 1).to(dtype)
    qk[:, -1] = torch.randint(0, 256, (64,)).to(dtype)  # each row's position, in the row

    def rope(t):
        x = t[:, :-1].clone().view(-1, 12, 64)
        ops.rope_(x, t[:, -1].long().contiguous(), cos, sin)
        return x

    _row_invariant(rope, qk)


def _attention_cases():
    cases = [(torch.float32, None, 9, 3, 64), (torch.bfloat16, None, 4, 4, 48), (torch.float32, None, 4, 2, 16)]
    if kernels.has_bf16_dot():  # the bf16 flash form: decode and per-token kernels in its sums
        cases += [(torch.bfloat16, None, 9, 3, 64), (torch.bfloat16, None, 8, 2, 128),
                  (torch.bfloat16, torch.float8_e4m3fn, 9, 3, 64)]  # fmt: skip
    return cases


@pytest.mark.parametrize(("dtype", "kv", "heads", "kvh", "d"), _attention_cases())
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_gives_a_query_the_same_bits_in_every_kernel_and_batch(dtype, kv, heads, kvh, d, threads):
    """One request's 130 query tokens after a 137-token prefix (chunks of 64 keys cut at 0, 64, ...):
    the per-token extend kernel; the flash kernel (vdpbf16ps form) whole and in three chunks; the
    decode kernel with each token alone (chunks over threads, then folded) and in batches of 1..64
    rows among other requests of other lengths (whole requests a thread): all equal, bit for bit."""
    was = torch.get_num_threads()
    kernels.set_threads(threads)  # the kernels' pool (and torch's): the split is what varies
    try:
        _check_attention(dtype, kv, heads, kvh, d)
    finally:
        kernels.set_threads(was)


def _check_attention(dtype, kv, heads, kvh, d):
    ps, pre, new = 16, 137, 130
    others = [5, 64, 65, 200, 1]  # neighbours' context lengths
    lens = [pre + new, *others]
    pages = sum(-(-n // ps) for n in lens) + 2
    k, v = _pool(kvh, pages, ps, d, dtype, 1)
    if kv is not None:
        k, v = (k * 2).to(kv), (v * 2).to(kv)
    table = _table(lens, ps, pages, 2)
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(new, heads, d, generator=g) * 2).to(dtype)
    scale = d**-0.5
    one = torch.tensor([0])
    ref = torch.zeros(new, heads * d, dtype=dtype)
    ops.extend_attention_(ref, q, k, v, table, one, one * 0, one * 0 + pre, one * 0 + new, scale)
    if dtype == torch.bfloat16 and kv is None and d % 64 == 0:
        flash = torch.zeros_like(ref)
        ops.flash_attention_(flash, q, k, v, table, one, one * 0, one * 0 + pre, one * 0 + new, scale, False)
        assert torch.equal(flash, ref)
        for a, b in ((0, 70), (70, 71), (71, new)):  # chunked prefill: later chunks over a prefix
            ops.flash_attention_(flash, q, k, v, table, one, one * 0 + a, one * 0 + pre + a, one * 0 + b - a, scale, False)
        assert torch.equal(flash, ref)
    for t in range(0, new, 7):  # alone
        got = ops.decode_attention(q[t : t + 1], k, v, table, one, torch.tensor([pre + t + 1]), scale)
        assert torch.equal(got[0], ref[t]), t
    for m in (1, 2, 3, 8, 17, 33, 64):  # among other requests: the target's tokens t < m at the front
        qn = torch.randn(m + len(others), heads, d, generator=g).to(dtype)
        qn[:m] = q[:m]
        rows = torch.tensor([0] * m + list(range(1, len(lens))))
        ln = torch.tensor([pre + t + 1 for t in range(m)] + others)
        got = ops.decode_attention(qn, k, v, table, rows, ln, scale)
        assert torch.equal(got[:m], ref[:m]), m
