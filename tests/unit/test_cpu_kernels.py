"""kvledger's C++ CPU kernels against torch references, in fp32 and bf16, on both ISA paths.

Tolerances: fp32 results differ from the reference only in the order of reductions (sums of squares,
dot products, softmax sums): relative 1e-5. bf16 outputs are rounded where torch rounds them (so the
elementwise ops are exact), and the attention output is within 1 bf16 rounding (2^-8 relative) of
the reference computed in float from the same bf16 K/V (the torch backend rounds its scores and
probabilities to bf16 as well, so it is further from the float result than the kernel is).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvledger import kernels

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")
ops = torch.ops.kvledger_cpu if kernels.load() else None
DTYPES = [torch.float32, torch.bfloat16]


def ref_rms_norm(x, w, eps):  # the model's torch path (transformers' order of operations)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def close(a, b, dtype, rel=None, atol=None):
    rel = rel if rel is not None else (1e-5 if dtype == torch.float32 else 2**-7)
    torch.testing.assert_close(a.float(), b.float(), rtol=rel, atol=rel * 1e-2 if atol is None else atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 40])  # 40: not a multiple of 16, the portable path
def test_rms_norm_and_fused_add(dtype, dim):
    torch.manual_seed(0)
    x = (torch.randn(37, dim) * 3).to(dtype)
    w = torch.randn(dim).to(dtype)
    close(ops.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), dtype)
    res = torch.randn(37, dim).to(dtype)
    want_res = res + x
    out = ops.add_rms_norm(res, x, w, 1e-5)
    assert torch.equal(res, want_res)  # one rounding, as torch's add
    close(out, ref_rms_norm(want_res, w, 1e-5), dtype)
    # a strided row view (the rows of a bigger buffer)
    big = torch.randn(37, dim * 2).to(dtype)
    close(ops.rms_norm(big[:, :dim], w, 1e-6), ref_rms_norm(big[:, :dim], w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1536, 24])
def test_silu_mul(dtype, dim):
    torch.manual_seed(1)
    gu = (torch.randn(33, 2 * dim) * 4).to(dtype)
    g, u = gu.chunk(2, dim=-1)
    want = F.silu(g) * u
    got = ops.silu_mul(gu)
    close(got, want, dtype, rel=1e-5 if dtype == torch.float32 else 2**-7)
    if dtype == torch.bfloat16:  # rounded where torch rounds: nearly all equal, the rest one ulp off
        assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 8])
def test_rope_in_place_matches_the_torch_rotation_exactly(dtype, head_dim):
    torch.manual_seed(2)
    t, heads = 19, 12
    half = head_dim // 2
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(300).float()[:, None] * inv[None]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    pos = torch.randint(0, 300, (t,))
    buf = torch.randn(t, heads * head_dim + 40).to(dtype)  # q|k heads inside a wider row (qkv)
    x = buf[:, : heads * head_dim].view(t, heads, head_dim)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    tail = buf[:, heads * head_dim :].clone()
    ops.rope_(x, pos, cos, sin)
    assert torch.equal(x, want)
    assert torch.equal(buf[:, heads * head_dim :], tail)  # nothing outside the heads written
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rope_(x, torch.full((t,), 300), cos, sin)


def _pool(kvh, pages, ps, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kvh, pages * ps, d, generator=g).to(dtype)
    v = torch.randn(kvh, pages * ps, d, generator=g).to(dtype)
    return k, v


def _table(lens, ps, pages, seed):
    """req_to_token rows over shuffled pages (a request's pages are not adjacent)."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max(max(lens), 1) // ps) * ps
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    perm = torch.randperm(pages, generator=g)
    nxt = 0
    for r, n in enumerate(lens):
        np_ = -(-n // ps)
        locs = (perm[nxt : nxt + np_, None] * ps + torch.arange(ps)).flatten()
        table[r, : np_ * ps] = locs
        nxt += np_
    return table


def ref_decode(q, k, v, table, rows, lens, scale, window=0):
    """Float attention of each request's heads over its tokens (GQA by head groups); ``window`` > 0:
    over its last ``window`` tokens only."""
    b, h, d = q.shape
    kvh = k.shape[0]
    out = torch.zeros(b, h, d)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        loc = table[rows[i], max(0, n - window) if window else 0 : n]
        ki = k[:, loc].float().repeat_interleave(h // kvh, 0)  # [H, n, D]
        vi = v[:, loc].float().repeat_interleave(h // kvh, 0)
        p = torch.softmax((ki @ q[i].float().unsqueeze(-1)).squeeze(-1) * scale, -1)
        out[i] = (p.unsqueeze(1) @ vi).squeeze(1)
    return out.reshape(b, h * d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize(("heads", "kvh"), [(4, 4), (9, 3), (16, 2)])  # GQA ratios 1, 3, 8
# The kernel's paths: 64 (K and V rows widened once for 4 heads at a time), 128 (V rows for 2),
# 48 (any multiple of 16: one head at a time).
@pytest.mark.parametrize("d", [64, 128, 48])
def test_decode_attention_reads_pages_in_place(dtype, ps, heads, kvh, d):
    lens = [1, 15, 16, 17, 33, 250, 1100]  # one token, page boundaries, long (split over threads)
    pages = sum(-(-n // ps) for n in lens) + 3
    k, v = _pool(kvh, pages, ps, d, dtype, 3)
    table = _table(lens, ps, pages, 4)
    rows = torch.tensor([6, 0, 1, 2, 3, 4, 5])  # requests in other slots than their order
    table = table[torch.argsort(rows)]
    blens = torch.tensor(lens)
    q = torch.randn(len(lens), heads, d).to(dtype)
    got = ops.decode_attention(q, k, v, table, rows, blens, d**-0.5)
    want = ref_decode(q, k, v, table, rows, blens, d**-0.5)
    close(
        got,
        want,
        dtype,
        rel=1e-5 if dtype == torch.float32 else 2**-8,
        atol=1e-5 if dtype == torch.float32 else 2**-8,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 64, 300])
def test_decode_attention_over_a_sliding_window(dtype, window):
    """``window``: each row attends its last ``window`` keys (the one-call decode's sliding layers),
    contexts shorter than the window all of theirs; long ones split over threads as without it."""
    d, heads, kvh, ps = 64, 8, 2, 16
    lens = [1, 6, 7, 8, 70, 1100]
    pages = sum(-(-n // ps) for n in lens) + 2
    k, v = _pool(kvh, pages, ps, d, dtype, 11)
    table = _table(lens, ps, pages, 12)
    rows, blens = torch.arange(len(lens)), torch.tensor(lens)
    q = torch.randn(len(lens), heads, d).to(dtype)
    got = ops.decode_attention(q, k, v, table, rows, blens, d**-0.5, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    close(got, ref_decode(q, k, v, table, rows, blens, d**-0.5, window), dtype, rel=tol, atol=tol)
    whole = ref_decode(q, k, v, table, rows, blens, d**-0.5)
    assert not torch.allclose(got.float()[-1], whole[-1], atol=1e-3)  # the window cut the long row
    with pytest.raises(RuntimeError, match="window must be"):
        ops.decode_attention(q, k, v, table, rows, blens, d**-0.5, window=-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_writes_the_new_token_first_and_handles_empty_contexts(dtype):
    d, heads, kvh, ps = 32, 6, 2, 16
    lens = [5, 0, 40]
    k, v = _pool(kvh, 8, ps, d, dtype, 5)
    table = _table([max(n, 1) for n in lens], ps, 8, 6)
    rows, blens = torch.arange(3), torch.tensor(lens)
    qkv = torch.randn(3, (heads + 2 * kvh) * d).to(dtype)  # q, k, v as views of one fused row
    q = qkv[:, : heads * d].view(3, heads, d)
    kn = qkv[:, heads * d : (heads + kvh) * d].view(3, kvh, d)
    vn = qkv[:, (heads + kvh) * d :].view(3, kvh, d)
    out_loc = torch.stack([table[0, 4], table[1, 0], table[2, 39]])
    k0, v0 = k.clone(), v.clone()
    got = ops.decode_attention(q, k, v, table, rows, blens, d**-0.5, kn, vn, out_loc)
    k0[:, out_loc] = kn.transpose(0, 1)
    v0[:, out_loc] = vn.transpose(0, 1)
    assert torch.equal(k, k0) and torch.equal(v, v0)  # the new K/V in their pages, nothing else
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    close(got, ref_decode(q, k0, v0, table, rows, blens, d**-0.5), dtype, rel=tol, atol=tol)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # an empty context attends to nothing


def test_decode_attention_rejects_bad_arguments_without_writing():
    d = 16
    k, v = _pool(2, 4, 16, d, torch.float32, 7)
    k0 = k.clone()
    table = _table([20], 16, 4, 8)
    q = torch.randn(1, 4, d)
    kn, vn = torch.randn(1, 2, d), torch.randn(1, 2, d)
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        ops.decode_attention(q, k, v, table, torch.tensor([0]), torch.tensor([10_000]), 0.25)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.decode_attention(
            q, k, v, table, torch.tensor([0]), torch.tensor([20]), 0.25, kn, vn, torch.tensor([64])
        )
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        ops.decode_attention(torch.randn(1, 3, d), k, v, table, torch.tensor([0]), torch.tensor([20]), 0.25)
    assert torch.equal(k, k0)


def test_fake_implementations_let_torch_compile_trace_the_ops():
    def f(x, w, gu):
        return ops.rms_norm(x, w, 1e-5) + ops.silu_mul(gu)

    x, w, gu = torch.randn(5, 32).bfloat16(), torch.randn(32).bfloat16(), torch.randn(5, 64).bfloat16()
    got = torch.compile(f, fullgraph=True, backend="eager")(x, w, gu)
    assert torch.equal(got, f(x, w, gu))


@pytest.mark.skipif(kernels.isa() != "avx512", reason="the CPU has no AVX-512: only the portable path runs")
def test_the_portable_path_passes_the_same_checks():
    """KVLEDGER_CPU_ISA=scalar picks the portable kernels when the library loads: run this file's
    kernel checks again in a process where it is set."""
    env = {**os.environ, "KVLEDGER_CPU_ISA": "scalar"}
    code = (
        "import torch, kvledger.kernels as k; assert k.load() and k.isa() == 'scalar', k.isa();"
        "import sys; sys.exit(__import__('pytest').main(['-q', '-x', '-p', 'no:cacheprovider', "
        f"{__file__!r}, '-k', 'not portable']))"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize(("heads", "kvh"), [(4, 4), (9, 3), (16, 2)])
def test_extend_attention_is_causal_over_prefix_and_new_tokens(dtype, ps, heads, kvh):
    """Prefill chunks with and without a cached prefix (crossing page boundaries), in one call; query
    token i of an extend sees exactly its prefix and the new tokens up to itself. Rows of other
    tokens (decodes sharing the forward) are left as they were."""
    exts = [(0, 1, 40), (2, 0, 2), (1, 17, 15), (3, 33, 70)]  # (slot row, prefix, new tokens)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    _check_causal(ops.extend_attention_, exts, dtype, ps, heads, kvh, 64, tol, seed=9, decodes=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kvh"), [(4, 1), (9, 3)])
def test_extend_attention_with_a_window_reads_each_querys_last_keys(dtype, heads, kvh):
    """``window`` W: query i of an extend sees its last W keys only (a sliding layer), each row the
    float reference's over those keys and bit for bit the decode kernel's with the same window (one
    order of sums whichever kernel reads a row); keys before every query's window are never read
    (their table entries point outside the pool here)."""
    ps, d, w = 16, 64, 24
    exts = [(0, 0, 70), (1, 40, 9), (2, 5, 3)]  # (slot row, prefix, new): cut, cut from the start, uncut
    lens = [p + n for _, p, n in exts]
    pages = sum(-(-n // ps) for n in lens) + 2
    k, v = _pool(kvh, pages, ps, d, dtype, 31)
    table = _table(lens, ps, pages, 32)
    for row, pre, _ in exts:  # a page given back out of window: its entries unreadable
        first = max(0, pre - w + 1)
        table[row, :first] = 1 << 40
    t = sum(n for _, _, n in exts)
    q = torch.randn(t, heads, d).to(dtype)
    out = torch.full((t, heads * d), 7.0).to(dtype)
    starts = [0, 70, 79]
    cols = [torch.tensor(c) for c in zip(*[(r, st, p, n) for (r, p, n), st in zip(exts, starts)])]
    ops.extend_attention_(out, q, k, v, table, *cols, d**-0.5, w)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    for (row, pre, n), st in zip(exts, starts):
        rows, lens_ = torch.full((n,), row), torch.arange(pre + 1, pre + n + 1)
        want = ref_decode(q[st : st + n], k, v, table, rows, lens_, d**-0.5, window=w)
        close(out[st : st + n], want, dtype, rel=tol, atol=tol)
        dec = ops.decode_attention(q[st : st + n].contiguous(), k, v, table, rows, lens_, d**-0.5, window=w)
        assert torch.equal(out[st : st + n], dec)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kvh", "d"), [(4, 1, 256), (9, 3, 64), (4, 4, 80), (16, 2, 128)])
@pytest.mark.parametrize("window", [0, 7, 64, 300])
def test_tiled_extend_gives_each_row_the_per_token_kernels_bits(dtype, heads, kvh, d, window):
    """Where the bf16 flash kernel does not run (float32, or a CPU without AVX512-BF16), long extends
    run in tiles of query tokens sharing each K row (``set_tiled_extend``): every row bit for bit the
    per-token kernel's (and so the decode kernel's: one order of sums per row), with and without a
    window (each token's chunks then start one key later than its predecessor's), a cached prefix,
    pages of 16 out of order, a head dim that is not a multiple of 64 (80) and Gemma 3's (4 heads on
    one KV head of 256); other rows of the forward untouched."""
    ps = 16
    exts = [(0, 0, 130), (1, 40, 33), (2, 5, 3), (3, 17, 64)]  # (slot row, prefix, new tokens)
    lens = [p + n for _, p, n in exts]
    pages = sum(-(-n // ps) for n in lens) + 2
    k, v = _pool(kvh, pages, ps, d, dtype, 41)
    table = _table(lens, ps, pages, 42)
    t = sum(n for _, _, n in exts) + 2  # 2 rows of no extend (decodes sharing the forward)
    q = (torch.randn(t, heads, d, generator=torch.Generator().manual_seed(43)) * 3).to(dtype)
    starts = [0, 130, 163, 166]
    cols = [torch.tensor(c) for c in zip(*[(r, st, p, n) for (r, p, n), st in zip(exts, starts)])]
    outs = []
    for tiled in (False, True):
        was = ops.set_tiled_extend(tiled)
        try:
            out = torch.full((t, heads * d), 7.0).to(dtype)
            ops.extend_attention_(out, q, k, v, table, *cols, d**-0.5, window)
            outs.append(out)
        finally:
            ops.set_tiled_extend(was)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1][-2:], torch.full((2, heads * d), 7.0).to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    for (row, pre, n), st in zip(exts, starts):
        rows, lens_ = torch.full((n,), row), torch.arange(pre + 1, pre + n + 1)
        want = ref_decode(q[st : st + n], k, v, table, rows, lens_, d**-0.5, window=window)
        close(outs[1][st : st + n], want, dtype, rel=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_each_tokens_heads_at_its_location(dtype):
    """``store_kv_``: the same pool as ATen's index write of [tokens, kv_heads, head_dim] rows (views
    of a fused QKV row included); other locations untouched."""
    kvh, d, locs = 2, 32, 50
    kc, vc = torch.randn(kvh, locs, d).to(dtype), torch.randn(kvh, locs, d).to(dtype)
    qkv = torch.randn(7, (4 + 2 * kvh) * d).to(dtype)
    k, v = qkv[:, 4 * d : (4 + kvh) * d].view(7, kvh, d), qkv[:, (4 + kvh) * d :].view(7, kvh, d)
    loc = torch.tensor([3, 49, 0, 17, 18, 30, 8])
    wk, wv = kc.clone(), vc.clone()
    wk[:, loc], wv[:, loc] = k.transpose(0, 1), v.transpose(0, 1)
    ops.store_kv_(kc, vc, k, v, loc)
    assert torch.equal(kc, wk) and torch.equal(vc, wv)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.store_kv_(kc, vc, k, v, loc + 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norm_ops_equal_the_step_order(dtype):
    """``add_kind_norm`` (Gemma's kind) is ``h += delta`` rounded to the dtype then ``kind_norm``, in
    one pass, over enough rows to split over the pool; ``gated_act``'s GELU-tanh in row blocks equals
    ATen's gelu times the up half; both within float32 rounding of Gemma's torch norm."""
    from kvledger.model.layers.norm import gemma_rms_norm

    rows, dim = 300, 96
    h = torch.randn(rows, dim).to(dtype)
    delta = torch.randn(rows, dim).to(dtype)
    w1 = 1.0 + torch.randn(dim) * 0.1
    want_h = h + delta
    want = ops.kind_norm(want_h, w1, 1, 1e-6)
    got = ops.add_kind_norm(h, delta, w1, 1, 1e-6)
    assert torch.equal(h, want_h) and torch.equal(got, want)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    close(got, gemma_rms_norm(want_h, w1, 1e-6), dtype, rel=tol, atol=tol)
    gu = torch.randn(rows, 2 * 4096).to(dtype)  # 4 rows a block: many blocks
    ref = F.gelu(gu[:, :4096], approximate="tanh") * gu[:, 4096:]
    assert torch.equal(ops.gated_act(gu, 1), ref)


def _check_causal(op, exts, dtype, ps, heads, kvh, d, tol, seed, decodes, q_scale=1.0):
    """``op`` (extend_attention_'s contract) over ``exts`` (slot row, prefix, new tokens) after
    ``decodes`` rows it must leave alone: each extend's rows equal the float reference within tol."""
    lens = [0] * len(exts)
    for row, pre, n in exts:
        lens[row] = pre + n
    pages = sum(-(-n // ps) for n in lens) + 2
    k, v = _pool(kvh, pages, ps, d, dtype, seed)
    table = _table(lens, ps, pages, seed + 1)
    t = decodes + sum(n for _, _, n in exts)
    q = (torch.randn(t, heads, d) * q_scale).to(dtype)
    out = torch.full((t, heads * d), 7.0).to(dtype)
    starts, s = [], decodes
    for _, _, n in exts:
        starts.append(s)
        s += n
    cols = [torch.tensor(c) for c in zip(*[(r, st, p, n) for (r, p, n), st in zip(exts, starts)])]
    op(out, q, k, v, table, *cols, d**-0.5)
    assert torch.equal(out[:decodes], torch.full((decodes, heads * d), 7.0).to(dtype))
    for (row, pre, n), st in zip(exts, starts):
        want = ref_decode(
            q[st : st + n], k, v, table, torch.full((n,), row), torch.arange(pre + 1, pre + n + 1), d**-0.5
        )
        close(out[st : st + n], want, dtype, rel=tol, atol=tol)


needs_bf16_dot = pytest.mark.skipif(
    not (kernels.load() and kernels.has_bf16_dot()),
    reason="the CPU has no AVX512-BF16 (or the portable ISA is forced)",
)


@needs_bf16_dot
@pytest.mark.parametrize(("heads", "kvh", "d"), [(9, 3, 64), (8, 2, 128)])
def test_flash_attention_over_a_float8_pool_equals_it_over_bf16_of_the_same_values(heads, kvh, d):
    """The vdpbf16ps form packs a float8 e4m3 pool by widening each value to bf16 (exact: 3 mantissa
    bits, e4m3's range): its outputs are bit-equal to those over a bf16 pool holding the float8
    values, for extends with and without a prefix, partial tiles and chunks. Values up to 4 with
    scale 2 (e4m3 subnormals and large codes both appear)."""
    exts = [(0, 0, 70), (1, 37, 29), (2, 130, 5)]
    lens = [p + n for _, p, n in exts]
    ps = 16
    pages = sum(-(-n // ps) for n in lens) + 2
    k, v = _pool(kvh, pages, ps, d, torch.float32, 23)
    k8, v8 = (k * 2).to(torch.float8_e4m3fn), (v * 2).to(torch.float8_e4m3fn)
    table = _table(lens, ps, pages, 24)
    t = sum(n for _, _, n in exts)
    q = torch.randn(t, heads, d).to(torch.bfloat16)
    starts = [0, 70, 99]
    cols = [torch.tensor(c) for c in zip(*[(r, st, p, n) for (r, p, n), st in zip(exts, starts)])]
    was = ops.set_flash_amx(False)  # the float8 pool takes this form on every CPU; compare like with like
    try:
        outs = []
        for kc, vc in ((k8, v8), (k8.to(torch.bfloat16), v8.to(torch.bfloat16))):
            out = torch.full((t, heads * d), 7.0).to(torch.bfloat16)
            ops.flash_attention_(out, q, kc, vc, table, *cols, d**-0.5)
            outs.append(out)
    finally:
        ops.set_flash_amx(was)
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], torch.full_like(outs[0], 7.0))


@needs_bf16_dot
@pytest.mark.parametrize("tiles", [False, True], ids=["vdpbf16ps", "amx"])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize(("heads", "kvh", "d"), [(4, 4, 64), (9, 3, 64), (16, 2, 64), (8, 2, 128)])
def test_flash_attention_is_causal_over_prefix_and_new_tokens(ps, heads, kvh, d, tiles):
    """The bf16 prefill kernel on the same contract as extend_attention_, in both of its forms (4 query
    rows a call with vdpbf16ps; 16 on AMX tiles where the CPU has them): extends with and without a
    prefix, lengths that leave partial tiles of query rows and partial chunks of keys (64; 128 on AMX,
    whose chunks past every row's position take the unmasked path), a prefix ending inside a chunk;
    other rows untouched. Within 2^-7 relative of the float reference (its probabilities are rounded
    to bf16 before P @ V, as torch's CPU flash attention rounds them)."""
    if tiles and not kernels.has_amx():
        pytest.skip("the CPU has no AMX tiles (or Linux refused this process the tile state)")
    exts = [(0, 0, 1), (2, 0, 130), (1, 17, 64), (3, 100, 77), (4, 63, 2), (5, 0, 300), (6, 130, 140)]
    was = ops.set_flash_amx(tiles)
    try:
        # q x 2: a sharper softmax than unit scores (slot row, prefix, new tokens)
        _check_causal(ops.flash_attention_, exts, torch.bfloat16, ps, heads, kvh, d, 2**-7, 19, 2, q_scale=2.0)
    finally:
        ops.set_flash_amx(was)


@needs_bf16_dot
def test_flash_attention_rejects_what_it_does_not_run():
    k, v = _pool(2, 4, 16, 64, torch.bfloat16, 11)
    table = _table([20], 16, 4, 12)
    q, out = torch.randn(5, 4, 64).bfloat16(), torch.zeros(5, 4 * 64).bfloat16()
    one = torch.tensor([0])
    cols = (one, one * 0, one * 0, torch.tensor([5]))
    with pytest.raises(RuntimeError, match="takes bfloat16"):
        ops.flash_attention_(out.float(), q.float(), k.float(), v.float(), table, *cols, 0.125)
    k32, v32 = _pool(2, 4, 16, 32, torch.bfloat16, 11)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.flash_attention_(
            torch.zeros(5, 128).bfloat16(), q[..., :32].contiguous(), k32, v32, table, *cols, 0.125
        )
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        ops.flash_attention_(out, q, k, v, table, one, one * 0, torch.tensor([30]), torch.tensor([5]), 0.125)
    assert torch.equal(out, torch.zeros(5, 4 * 64).bfloat16())


def test_extend_attention_rejects_ranges_outside_the_tables():
    d = 16
    k, v = _pool(2, 4, 16, d, torch.float32, 11)
    table = _table([20], 16, 4, 12)
    q, out = torch.randn(5, 4, d), torch.zeros(5, 4 * d)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        ops.extend_attention_(out, q, k, v, table, one, one * 0, torch.tensor([30]), torch.tensor([5]), 0.25)
    with pytest.raises(RuntimeError, match="outside q"):
        ops.extend_attention_(out, q, k, v, table, one, torch.tensor([3]), one * 0, torch.tensor([5]), 0.25)
    assert torch.equal(out, torch.zeros(5, 4 * d))


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_start():
    """torch serializes extension builds with a ``lock`` file in the build directory; a process killed
    while it held it (a first start stopped during the build) left it behind, and the next start
    waited on it forever. The loader now holds a flock of its own and clears such a leftover."""
    from torch.utils.cpp_extension import _get_build_directory

    stale = os.path.join(_get_build_directory("kvledger_cpu_ops", verbose=False), "lock")
    open(stale, "w").close()  # what a build killed mid-way leaves
    try:
        r = subprocess.run(
            [sys.executable, "-c", "import kvledger.kernels as k; print(k.load(), k.status())"],
            capture_output=True,
            text=True,
            timeout=120,  # without the fix: waits on the file until this kills it
        )
    finally:
        left = os.path.exists(stale)
        if left:
            os.unlink(stale)
    assert r.stdout.split()[:2] == ["True", "loaded"], r.stdout + r.stderr
    assert not left
    assert "left by a build or load that was killed" in r.stderr
