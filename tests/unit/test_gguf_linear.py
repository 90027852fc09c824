"""``kvledger_cpu::gguf_linear``: a GGUF file's blocks read as stored (``csrc/gguf_blocks.h``), per kind,
against ``gguf.quants.dequantize`` then a float64 matmul.

The bound. The kernel quantizes each group of 32 activations to ``sx * xq`` (``sx = max|x| / 127``,
round to nearest), so each element is off by at most ``sx / 2``; everything after is exact integer
dots and float32 sums. Hence, per output,

    |y - x @ W.T| <= A + F,   A = sum_g (sx_g / 2) * sum_{k in g} |W[n, k]|,
                              F = (K / 16 + 8) * 2**-24 * sum_k |W[n, k]| * (|x_k| + sx_g / 2)

``A`` is the activations' rounding (it dominates: about 1% of the output's scale); ``F`` covers the
float32 sums and gguf's own float32 rounding of ``d * sc * q``: the longest chain of additions into one
float is the tiles' path's (calls of ``kGgufTileRows`` = 8 rows and more: one fused multiply-add per
unit of 32 inputs, 16 for Q6_K, and one per group for the mins, so K / 16 at most), each term with the
product of the two scales rounded once more; the rows' path has K / 64 a lane, K / 512 for the mins and
a 4-level tree. ``A`` is a worst case
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
    f = (k / 16 + 8) * 2.0**-24 * ((xg.abs() + half[..., None]).view(m, k) @ w.abs().T)
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


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
def test_the_tiles_path_and_the_rows_path_agree_and_tile_rows_0_keeps_rows_alone(kind):
    """From 8 rows the tiles' path (another order of sums of the same products): within twice ``F`` of
    the rows' path's result; with ``tile_rows=0`` a row's output is the same bits alone or in a batch."""
    rng = np.random.default_rng(5)
    n, k = (70, 512) if KINDS[kind][0] == 256 else (70, 160)  # tiles of 32, 16 and a part one
    raw = torch.from_numpy(random_blocks(kind, n, k, rng))
    tid = int(gguf.GGMLQuantizationType[kind])
    x = torch.randn(9, k)
    tiled = torch.ops.kvledger_cpu.gguf_linear(x, raw, tid, n, k)
    rowwise = torch.ops.kvledger_cpu.gguf_linear(x, raw, tid, n, k, None, 0)
    alone = torch.cat([torch.ops.kvledger_cpu.gguf_linear(x[i : i + 1], raw, tid, n, k) for i in range(9)])
    assert torch.equal(rowwise, alone)
    assert not torch.equal(tiled, rowwise)  # the tiles' path did run
    w = dequantized(kind, raw.numpy())
    scale = x.double().abs() @ w.abs().T
    assert ((tiled.double() - rowwise.double()).abs() <= 2 * (k / 16 + 8) * 2.0**-24 * scale * 1.01).all()


def test_rejects_blocks_that_do_not_match():
    raw = random_blocks("Q4_K", 4, 256, np.random.default_rng(0))
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="blocks do not match"):
        torch.ops.kvledger_cpu.gguf_linear(x, torch.from_numpy(raw), 12, 5, 256)
    with pytest.raises(RuntimeError, match="no kernel"):
        torch.ops.kvledger_cpu.gguf_linear(x, torch.from_numpy(raw), 16, 4, 256)  # IQ2_XXS


def scalar_outputs(tmp_path, cases: list, call: str) -> list:
    """``call`` (a lambda's source over a case's fields) on every case in a fresh process whose kernels
    run the portable (scalar) ISA: what a CPU without AVX512-VNNI computes."""
    torch.save(cases, tmp_path / "cases.pt")
    code = (
        "import torch, gguf; from kvledger import kernels;"
        "assert kernels.load() and kernels.quant_isa() == 'scalar';"
        f"cases = torch.load({str(tmp_path / 'cases.pt')!r}); f = {call};"
        f"torch.save([f(*c) for c in cases], {str(tmp_path / 'out.pt')!r})"
    )
    env = {**os.environ, "KVLEDGER_CPU_ISA": "scalar"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


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
    call = (
        "lambda kind, w, x: torch.ops.kvledger_cpu.gguf_linear("
        "x, w, int(gguf.GGMLQuantizationType[kind]), w.shape[0], x.shape[1])"
    )
    for (kind, w, x), y in zip(cases, scalar_outputs(tmp_path, cases, call)):
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


# --- the load-time repack (csrc/gguf_blocks.h, gguf_repack.cpp; kernels/gguf_weight.GgufWeight.repack) ---------

REPACK_KINDS = ["Q4_K", "Q6_K", "Q8_0", "Q5_0"]


def repacked(kind: str, raw: np.ndarray) -> torch.Tensor:
    tid = int(gguf.GGMLQuantizationType[kind])
    w = torch.from_numpy(raw).reshape(-1).contiguous()
    k = raw.shape[1] // KINDS[kind][1] * KINDS[kind][0]
    return torch.ops.kvledger_cpu.gguf_repack([w], torch.tensor([[tid, raw.shape[0]]]), k, False)


def run_packed(kind: str, packed: torch.Tensor, n: int, x: torch.Tensor, tile_rows: int = -1) -> torch.Tensor:
    tid = int(gguf.GGMLQuantizationType[kind]) + 100
    return torch.ops.kvledger_cpu.gguf_linear(x, packed, tid, n, x.shape[1], None, tile_rows)


@pytest.mark.parametrize("kind", REPACK_KINDS)
def test_repack_keeps_the_bytes_and_undoes_exactly(kind):
    """Same bits in another order: the inverse gives the file's bytes back (every byte pattern of codes,
    scales and mins); the repacked size is whole groups of 16 rows of the file's (Q4_K: 148 bytes a row
    and super-block for its 144, the 6-bit scales and mins a byte each; the others exactly the file's);
    K of one to several blocks, an odd number of 32-blocks among them for Q8_0 / Q5_0."""
    rng = np.random.default_rng(2)
    tid = int(gguf.GGMLQuantizationType[kind])
    block, nbytes = KINDS[kind][:2]
    for n, k in ((40, 768), (23, 256), (16, 1024), (1, 512)) + (((17, 96), (5, 32)) if block == 32 else ()):
        raw = random_blocks(kind, n, k, rng)
        packed = repacked(kind, raw)
        per_block = 148 if kind == "Q4_K" else nbytes
        assert packed.numel() == (n + 15) // 16 * 16 * (k // block) * per_block
        back = torch.ops.kvledger_cpu.gguf_repack([packed], torch.tensor([[tid + 100, n]]), k, True)
        assert torch.equal(back, torch.from_numpy(raw).reshape(-1))
    with pytest.raises(RuntimeError, match="has no repack"):
        torch.ops.kvledger_cpu.gguf_repack([torch.zeros(18 * 8, dtype=torch.uint8)], torch.tensor([[2, 1]]), 256)


@pytest.mark.parametrize("kind", REPACK_KINDS)
def test_repacked_kernel_equals_the_tiles_path_bit_for_bit_at_every_batch(kind):
    """The repacked kernel computes the tiles' sums in the tiles' order (csrc/gguf_blocks.h) from 1 row
    on: equal bit for bit to the tiles' path on the file's blocks (forced with tile_rows=1), hence
    within that path's bound of dequantize-then-matmul; float32 and bf16; N not a multiple of 16 (a
    padded group), K of one to several super-blocks, 1..9 activation rows."""
    rng = np.random.default_rng(4)
    torch.manual_seed(4)
    tid = int(gguf.GGMLQuantizationType[kind])
    extra = ((33, 96), (17, 640)) if KINDS[kind][0] == 32 else ()  # K of 3 and 20 blocks of 32
    for n, k in ((40, 768), (23, 256), (70, 512), (9, 1280), *extra):
        raw = random_blocks(kind, n, k, rng)
        packed = repacked(kind, raw)
        w = dequantized(kind, raw)
        blocks = torch.from_numpy(raw)
        for m in range(1, 10):
            x = torch.randn(m, k)
            x[:, :5] *= 20
            for xd in (x, x.bfloat16()):
                tiles = torch.ops.kvledger_cpu.gguf_linear(xd, blocks, tid, n, k, None, 1)
                got = run_packed(kind, packed, n, xd)
                assert torch.equal(got, tiles), (kind, n, k, m, xd.dtype)
            y = run_packed(kind, packed, n, x).double()
            ref = x.double() @ w.T
            err = (y - ref).abs()
            assert (err <= bound(x, w)).all(), (kind, n, k, m)
            assert err.mean() < 0.05 * ref.abs().mean(), (kind, n, k, m)


@pytest.mark.parametrize("kind", REPACK_KINDS)
def test_repacked_rows_have_one_order_of_sums_whatever_the_batch(kind):
    """Deterministic mode's contract (tile_rows=0) holds on the repacked kernel at any tile_rows: a row's
    output is the same bits alone or in a batch of 9."""
    rng = np.random.default_rng(6)
    n, k = 70, 512
    packed = repacked(kind, random_blocks(kind, n, k, rng))
    x = torch.randn(9, k)
    for tile_rows in (0, -1):
        batch = run_packed(kind, packed, n, x, tile_rows)
        alone = torch.cat([run_packed(kind, packed, n, x[i : i + 1], tile_rows) for i in range(9)])
        assert torch.equal(batch, alone)


def test_a_repacked_stack_of_kinds_runs_each_part_in_its_kind():
    """A fused q/k/v of Q4_K, Q4_K and Q6_K parts (as a Q4_K_M file stores them), the middle part not a
    multiple of 16 rows: repacked through GgufWeight, equal to the tiles' path on the file's blocks, and
    its rows (the repack undone) the file's values."""
    from kvledger.kernels.gguf_weight import GgufWeight

    rng = np.random.default_rng(8)
    k = 512
    parts = (("Q4_K", 48), ("Q4_K", 21), ("Q6_K", 32))
    raws = [random_blocks(kind, n, k, rng) for kind, n in parts]
    stack = GgufWeight(parts, k, torch.from_numpy(np.concatenate([r.reshape(-1) for r in raws])))
    x = torch.randn(5, k)
    tiles = torch.ops.kvledger_cpu.gguf_linear(x, stack.w, 0, stack.out_features, k, stack.scales, 1)
    want_rows = stack.rows()
    assert stack.repackable()
    stack.repack()
    assert stack.packed and stack.bits == -112
    assert torch.equal(stack(x), tiles)
    assert torch.equal(stack.rows(), want_rows)
    # Q5_0 q/k beside a Q8_0 v (a Q4_K_M file's Gemma attention), K of 20 blocks of 32
    parts32 = (("Q5_0", 40), ("Q5_0", 7), ("Q8_0", 20))
    raws = [random_blocks(kind, n, 640, rng) for kind, n in parts32]
    stack32 = GgufWeight(parts32, 640, torch.from_numpy(np.concatenate([r.reshape(-1) for r in raws])))
    x = torch.randn(9, 640)
    tiles = torch.ops.kvledger_cpu.gguf_linear(x, stack32.w, 0, stack32.out_features, 640, stack32.scales, 1)
    want_rows = stack32.rows()
    stack32.repack()
    assert torch.equal(stack32(x), tiles)
    assert torch.equal(stack32.rows(), want_rows)
    for kind in ("Q6_K", "Q8_0", "Q5_0"):  # an embedding's look-ups unpack only the groups they need
        single = GgufWeight(((kind, 40),), k, torch.from_numpy(random_blocks(kind, 40, k, rng)))
        want = single.rows()
        single.repack()
        index = torch.tensor([[3, 39], [17, 3]])
        assert torch.equal(single.rows(index), want[index.reshape(-1)])


def test_a_fused_projection_is_repacked_part_by_part_from_the_files_views():
    """The builder leaves a fused gate/up or q/k/v of repacked kinds as views of the file (``cat_rows``
    apart) and the repack reads each part into the one buffer: the same bytes as repacking the
    concatenation, a run of one kind served as one part (as the concatenated tensor was), a part of
    rows not whole groups of 16 kept apart (its padding group between); the outputs equal the
    concatenated layer's bit for bit; a count of inputs or a size that does not match the parts refused."""
    from kvledger.kernels.gguf_weight import GgufWeight
    from kvledger.model.linear import Linear, repacked_at_load
    from kvledger.model.quantized import BlockStack, BlockWeight, cat_rows

    if not kernels.load() or kernels.quant_isa() != "avx512-vnni":
        pytest.skip("the load-time repack needs the VNNI kernel")
    rng = np.random.default_rng(9)
    k = 512
    for parts in ((("Q4_K", 48), ("Q4_K", 32)), (("Q6_K", 21), ("Q6_K", 16), ("Q4_K", 16))):
        blocks = [BlockWeight.from_gguf(kind, random_blocks(kind, n, k, rng)) for kind, n in parts]
        assert repacked_at_load(blocks)
        apart = cat_rows(blocks, apart=True)
        assert isinstance(apart, BlockStack)
        fused = Linear(apart, None, "int4", dtype=torch.bfloat16)
        whole = GgufWeight(parts, k, torch.from_numpy(np.concatenate([b.raw.reshape(-1) for b in blocks])))
        whole.repack()
        assert torch.equal(fused.qw.w, whole.w)
        want_parts = (("Q4_K", 80),) if parts[0][1] == 48 else parts  # 21 rows: not one run
        assert fused.qw.parts == want_parts and fused.qw.packed
        x = torch.randn(6, k, dtype=torch.bfloat16)
        assert torch.equal(fused.qw(x), whole(x))
    segs = torch.tensor([[int(gguf.GGMLQuantizationType["Q6_K"]), 16]] * 2)
    one = torch.from_numpy(random_blocks("Q6_K", 16, k, rng)).reshape(-1)
    with pytest.raises(RuntimeError, match="2 inputs for 3 parts"):
        torch.ops.kvledger_cpu.gguf_repack([one, one], torch.cat([segs, segs[:1]]), k, False)
    with pytest.raises(RuntimeError, match="part 1 holds"):
        torch.ops.kvledger_cpu.gguf_repack([one, one[:-1]], segs, k, False)


def test_a_q_k_projection_is_repacked_through_llama_cpps_row_order_without_a_copy():
    """A Llama GGUF's q and k rows in llama.cpp's interleaved order (``unpermute_qk`` on blocks): the
    weight reads them in HF's order without copying the file's bytes (``stored`` is the same view), and
    the repack reads that order in place (the segments' heads column): the same repacked bytes and the
    same outputs as repacking the unpermuted copy; ``raw`` (the copy, for everything else) in HF's
    order; whole heads of a shard stay a view; heads that do not divide the rows refused."""
    from kvledger.kernels.gguf_weight import GgufWeight
    from kvledger.model.gguf_map import permute_qk, unpermute_qk
    from kvledger.model.linear import Linear
    from kvledger.model.quantized import BlockWeight, cat_rows

    if not kernels.load() or kernels.quant_isa() != "avx512-vnni":
        pytest.skip("the load-time repack needs the VNNI kernel")
    rng = np.random.default_rng(11)
    k = 512
    heads = {"q": 4, "k": 2}
    hf = {n: random_blocks(kind, 4 * 16, k, rng) for n, kind in (("q", "Q4_K"), ("k", "Q4_K"), ("v", "Q6_K"))}
    hf["k"] = hf["k"][:32]
    stored = {n: permute_qk(torch.from_numpy(hf[n]), heads[n]).numpy() for n in ("q", "k")}
    q = unpermute_qk(BlockWeight.from_gguf("Q4_K", stored["q"]), heads["q"])
    kk = unpermute_qk(BlockWeight.from_gguf("Q4_K", stored["k"]), heads["k"])
    v = BlockWeight.from_gguf("Q6_K", hf["v"])
    assert np.shares_memory(q.stored, stored["q"])  # a view: nothing copied
    assert np.array_equal(q.raw, hf["q"].reshape(q.raw.shape))  # the copy, in HF's order
    fused = Linear(cat_rows([q, kk, v], apart=True), None, "int4", dtype=torch.bfloat16)
    flat = np.concatenate([hf[n].reshape(-1) for n in ("q", "k", "v")])
    whole = GgufWeight((("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 64)), k, torch.from_numpy(flat))
    whole.repack()
    assert torch.equal(fused.qw.w, whole.w)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    assert torch.equal(fused.qw(x), whole(x))
    alone = Linear(unpermute_qk(BlockWeight.from_gguf("Q4_K", stored["q"]), heads["q"]), None, "int4",
                   dtype=torch.bfloat16)
    one = GgufWeight((("Q4_K", 64),), k, torch.from_numpy(hf["q"].reshape(-1).copy()))
    one.repack()
    assert torch.equal(alone.qw.w, one.w)
    shard = q.rows(slice(16, 48))  # heads 1 and 2 of 4 (16 rows a head)
    assert shard.heads == 2 and np.shares_memory(shard.stored, stored["q"])
    assert np.array_equal(shard.raw, hf["q"][16:48].reshape(shard.raw.shape))
    assert np.array_equal(q.rows(slice(8, 24)).raw, hf["q"][8:24].reshape(16, *q.raw.shape[1:]))
    segs = torch.tensor([[int(gguf.GGMLQuantizationType["Q4_K"]), 64, 3]])
    with pytest.raises(RuntimeError, match="not 3 heads"):
        torch.ops.kvledger_cpu.gguf_repack([torch.from_numpy(stored["q"]).reshape(-1)], segs, k, False)


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
def test_head_argmax_on_repacked_blocks(kind):
    """A head repacked (a Q4_K_M file's Q6_K output.weight, or Gemma's tied Q8_0 token table):
    head_argmax over chunks of 4,096 outputs of the packed groups, n not a multiple of 16, picks
    gguf_linear's argmax, at 1 and 3 rows."""
    rng = np.random.default_rng(9)
    n, k = 9003, 256
    packed = repacked(kind, random_blocks(kind, n, k, rng))
    pid = -(int(gguf.GGMLQuantizationType[kind]) + 100)
    empty = torch.empty(0, 2, dtype=torch.int64)
    for m in (1, 3):
        x = torch.randn(m, k)
        logits = run_packed(kind, packed, n, x)
        for valid in (n, 8195, 17):
            got = torch.ops.kvledger_cpu.head_argmax(x, packed, empty, None, pid, n, valid)
            assert torch.equal(got, logits[:, :valid].max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="GGUF blocks do not match"):
        torch.ops.kvledger_cpu.head_argmax(x, packed[:-1], empty, None, pid, n, n)


@pytest.mark.skipif(kernels.quant_isa() != "avx512-vnni", reason="no AVX512-VNNI: only the portable path runs")
def test_the_portable_repacked_path_is_bit_identical(tmp_path):
    rng = np.random.default_rng(12)
    cases = []
    for kind in REPACK_KINDS:
        raw = random_blocks(kind, 40, 768, rng)
        for m in (1, 9):
            cases.append((int(gguf.GGMLQuantizationType[kind]) + 100, repacked(kind, raw), torch.randn(m, 768)))
    call = "lambda kind, w, x: torch.ops.kvledger_cpu.gguf_linear(x, w, kind, 40, x.shape[1])"
    for (kind, w, x), y in zip(cases, scalar_outputs(tmp_path, cases, call)):
        assert torch.equal(torch.ops.kvledger_cpu.gguf_linear(x, w, kind, 40, x.shape[1]), y), kind
