"""``--kv-cache-dtype fp8_e4m3``: the KV pool in float8 e4m3, written clamped and rounded to nearest
even (the C++ decode kernel and torch's cast agree bit for bit), read widened by every attention path
(the decode kernel, the one-call decode, SDPA extends, the torch backend), in the ledger's books
like any pool, and twice the tokens in the same bytes."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger import kernels
from kvledger.config import EngineConfig
from kvledger.errors import ValidationError
from kvledger.launch.validate import check_settings
from kvledger.model.kv_cast import FP8_MAX, to_cache
from tests.engine.test_disagg import pd  # noqa: F401 (the PD pair fixture)

F8 = torch.float8_e4m3fn
GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": True}
needs_kernels = pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(5, 120))] for _ in range(n)]


def test_the_setting_takes_sglang_and_vllm_spellings_and_refuses_others():
    assert EngineConfig.from_flat(kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig.from_flat(kv_cache_dtype="FP8_E4M3").cache.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValidationError, match="kv_cache_dtype must be one of auto, fp8_e4m3"):
        check_settings(EngineConfig.from_flat(kv_cache_dtype="int3"))
    with pytest.raises(ValidationError, match="HiSparse"):
        check_settings(EngineConfig.from_flat(kv_cache_dtype="fp8", enable_hisparse=True))


def test_a_value_beyond_float8_saturates_instead_of_becoming_nan():
    x = torch.tensor([1e6, -1e6, 500.0, 447.0, 0.3, float("inf")])
    got = to_cache(x, F8).float()
    assert not got.isnan().any()
    assert got.tolist()[:4] == [FP8_MAX, -FP8_MAX, FP8_MAX, 448.0] and got[-1] == FP8_MAX


@needs_kernels
def test_the_decode_kernel_writes_what_torch_casts_for_every_bfloat16():
    """Every finite bfloat16 through the kernel's write of the new tokens' K/V: the same bytes as
    ``to_cache`` (torch's cast of the clamped value), subnormals and saturation included."""
    kvh, d, b = 2, 64, 8
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[values.isfinite()]
    n = values.numel() - values.numel() % (b * kvh * d)
    want = to_cache(values[:n], F8).view(torch.uint8).view(-1, b, kvh, d)
    x = values[:n].view(-1, b, kvh, d)
    k_cache = torch.zeros(kvh, 64, d, dtype=F8)
    v_cache = torch.zeros_like(k_cache)
    table = torch.arange(64, dtype=torch.int64).view(1, -1).repeat(b, 1)
    rows, lens, loc = torch.arange(b), torch.ones(b, dtype=torch.int64), torch.arange(b) * 3 + 1
    q = torch.randn(b, 4, d).bfloat16()
    for i in range(x.shape[0]):
        torch.ops.kvledger_cpu.decode_attention(q, k_cache, v_cache, table, rows, lens, 0.1, x[i], x[i], loc)
        assert torch.equal(k_cache[:, loc].transpose(0, 1).view(torch.uint8), want[i])
        assert torch.equal(v_cache[:, loc].transpose(0, 1).view(torch.uint8), want[i])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_casts_equal_torchs(dtype):
    """``to_f8`` is torch's cast of the clamped value, ``from_f8`` torch's widening, for every code
    (the NaN codes included) and lengths that leave a tail to the scalar loop."""
    codes = torch.arange(256 * 3 + 5, dtype=torch.int32).remainder(256).to(torch.uint8).view(F8)
    wide = torch.ops.kvledger_cpu.from_f8(codes, dtype)
    want = codes.to(dtype)
    assert ((wide == want) | (wide.isnan() & want.isnan())).all()
    x = (torch.randn(1003) * 200).to(dtype)
    assert torch.equal(torch.ops.kvledger_cpu.to_f8(x).view(torch.uint8), x.clamp(-FP8_MAX, FP8_MAX).to(F8).view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_decode_attention_over_float8_equals_attention_over_its_widened_values(head_dim):
    torch.manual_seed(head_dim)
    b, heads, kvh, pool = 6, 8, 2, 4096
    k_cache = to_cache(torch.randn(kvh, pool, head_dim) * 4, F8)
    v_cache = to_cache(torch.randn(kvh, pool, head_dim), F8)
    lens = torch.tensor([1, 17, 64, 300, 700, 5])
    table = torch.stack([torch.randperm(pool)[:700] for _ in range(b)])
    q = torch.randn(b, heads, head_dim)
    out = torch.ops.kvledger_cpu.decode_attention(q, k_cache, v_cache, table, torch.arange(b), lens, 0.2)
    kf, vf = k_cache.float(), v_cache.float()
    for i in range(b):
        idx = table[i, : lens[i]]
        ke, ve = kf[:, idx].repeat_interleave(heads // kvh, 0), vf[:, idx].repeat_interleave(heads // kvh, 0)
        ref = torch.softmax(q[i].unsqueeze(1) @ ke.transpose(1, 2) * 0.2, -1) @ ve
        torch.testing.assert_close(out[i], ref.reshape(-1), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_the_engine_keeps_float8_pages_sized_at_one_byte_a_value(make_engine, monkeypatch):
    """The default pool is sized from the float8 bytes a token: twice bfloat16's tokens in the budget."""
    from kvledger.engine import resources

    monkeypatch.setattr(resources, "DEFAULT_MAX_KV_TOKENS", 1 << 40)  # the budget binds, not the cap
    monkeypatch.setattr(resources, "DEFAULT_KV_BYTES", 1 << 22)
    monkeypatch.setattr(resources, "_ram_bytes", lambda: 1 << 40)
    auto = make_engine(dtype="bfloat16", max_total_tokens=None)
    fp8 = make_engine(dtype="bfloat16", max_total_tokens=None, kv_cache_dtype="fp8_e4m3")
    assert fp8.core.runner.kv_buffer.k.dtype == F8 and auto.core.runner.kv_buffer.k.dtype == torch.bfloat16
    tokens = [e.core.cfg.cache.max_total_tokens for e in (auto, fp8)]
    assert tokens[1] == 2 * tokens[0], tokens
    assert fp8.core.runner.kv_buffer.k.nbytes == auto.core.runner.kv_buffer.k.nbytes  # the same memory


@needs_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_cpu_kernels_and_the_torch_backend_agree_over_a_float8_pool(make_engine, dtype):
    """The same mixed workload (chunked prefills beside decodes, a prefix-cache hit) on both backends
    over a float8 pool: both read the same widened values, so chosen-token logprobs agree within
    0.05 and most outputs are equal throughout (the sums differ in order only: measured 6-8 of 9)."""
    prompts = _prompts(8)
    prompts.append(prompts[0] + [7, 8, 9])  # a prefix-cache hit on float8 pages
    outs = {}
    for backend in ("torch", "cpu"):
        eng = make_engine(
            dtype=dtype, attention_backend=backend, kv_cache_dtype="fp8", chunked_prefill_size=40,
            enable_mixed_chunk=True,
        )  # fmt: skip
        outs[backend] = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        assert eng.core.runner.kv_buffer.k.dtype == F8
    same = 0
    for a, b in zip(outs["torch"], outs["cpu"]):
        ids_a, ids_b = a["output_ids"], b["output_ids"]
        n = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), len(ids_a))
        same += n == len(ids_a)
        lp_a = [t[0] for t in a["meta_info"]["output_token_logprobs"][:n]]
        lp_b = [t[0] for t in b["meta_info"]["output_token_logprobs"][:n]]
        assert max((abs(x - y) for x, y in zip(lp_a, lp_b)), default=0.0) < 0.05
    assert same >= 6, same  # (as the bfloat16 kernels against torch: near-ties may flip)


@needs_kernels
def test_decodes_in_one_kernel_call_equal_the_python_loop_over_float8(make_engine, monkeypatch):
    """The one-call decode writes and reads the float8 pool through the same kernel as the loop."""
    from kvledger.model import causal_lm as llama

    runs = {}
    for one_call in (False, True):
        monkeypatch.setattr(llama, "DECODE_IN_ONE_CALL", one_call)
        eng = make_engine(dtype="bfloat16", quantization="int4", kv_cache_dtype="fp8_e4m3", chunked_prefill_size=32)
        outs = eng.generate(input_ids=_prompts(6), sampling_params=GREEDY)
        runs[one_call] = [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]
        assert (eng.core.model.one_call_forwards > 0) == one_call
    assert runs[True] == runs[False]


@needs_kernels
def test_float8_pages_go_down_the_hierarchy_and_come_back_the_same(make_engine):
    """A float8 pool's pages written to the host tier and loaded back: the same outputs as an engine
    whose pool holds everything (the host pool keeps the pool's element type)."""
    rng = random.Random(2)
    fams = [[rng.randrange(1, 250) for _ in range(96)] for _ in range(8)]
    prompts = [f + [rng.randrange(1, 250) for _ in range(8)] for f in fams for _ in range(2)]
    g = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}

    def run(eng):
        return [eng.generate(input_ids=p, sampling_params=g)["output_ids"] for _ in range(2) for p in prompts]

    flat = run(make_engine(dtype="bfloat16", kv_cache_dtype="fp8", page_size=4, max_total_tokens=8192))
    eng = make_engine(
        dtype="bfloat16", kv_cache_dtype="fp8", page_size=4, max_total_tokens=256, enable_hierarchical_cache=True,
        hicache_ratio=8,
    )  # fmt: skip
    assert run(eng) == flat
    assert eng.memory()["hicache"]["l2_hit_tokens"] >= 96  # pages did come back from the host tier
    assert eng.core.kv_manager.tiers.mover.host.data.dtype == F8


def test_pd_moves_float8_pages_and_refuses_a_decode_side_of_another_dtype(pd, make_engine):  # noqa: F811
    """Both sides float8: the decode side's greedy tokens equal one float8 engine's (the pages' bytes
    cross as they are). A decode side whose pool is bfloat16 is refused by the prefill side (the
    layout names the dtype): the request ends with the reason, and both sides' books balance."""
    from tests.engine.test_disagg import drive, room, stats

    g = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    prompts = _prompts(3, seed=9)
    ref = make_engine(dtype="bfloat16", kv_cache_dtype="fp8")
    want = [ref.generate(input_ids=p, sampling_params=g)["output_ids"] for p in prompts]
    fp8 = {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}
    pre, dec, port = pd(prefill_kw=fp8, decode_kw=fp8)
    for i, p in enumerate(prompts):
        pre.add_request(p, g, rid=f"p{i}", disagg=room(port, 300 + i))
        dec.add_request(p, g, rid=f"d{i}", disagg=room(port, 300 + i))
    res = drive([pre, dec], {id(pre): [f"p{i}" for i in range(3)], id(dec): [f"d{i}" for i in range(3)]})
    assert [res[f"d{i}"]["output_ids"] for i in range(3)] == want
    assert stats(dec)["transfers_ok"] == 3

    pre2, dec2, port2 = pd(prefill_kw=fp8, decode_kw={"dtype": "bfloat16"})
    pre2.add_request(prompts[0], g, rid="p", disagg=room(port2, 400))
    dec2.add_request(prompts[0], g, rid="d", disagg=room(port2, 400))
    out = drive([pre2, dec2], {id(pre2): ["p"], id(dec2): ["d"]})
    reason = out["d"]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "layout" in str(reason.get("message", "")).lower(), reason


@needs_kernels
def test_a_float8_pools_long_extends_take_the_flash_kernel_off_amx_and_sdpa_on_it():
    """The vdpbf16ps flash kernel widens a float8 pool as it packs; the AMX form packs bf16 only, and
    on AMX SDPA beats the vdpbf16ps form, so there a float8 pool's long extends go to SDPA."""
    from kvledger.model.attention_cpu import FLASH_MIN_NEW, CpuAttention, flash_usable

    if not flash_usable(torch.bfloat16, 64):
        pytest.skip("the CPU has no AVX512-BF16")
    att = CpuAttention(9, 3, 64, torch.bfloat16)
    att.kv_dtype = F8
    att.flash_amx = False
    assert att._flash_ok and att._in_kernel(0, 4 * FLASH_MIN_NEW) and not att._amx_ok
    att.flash_amx = True  # as on a CPU with AMX tiles
    assert not att._flash_ok and not att._amx_ok and not att._in_kernel(0, 4 * FLASH_MIN_NEW)
    att.kv_dtype = None  # a bf16 pool there: the AMX form
    assert att._flash_ok and att._amx_ok


@needs_kernels
@pytest.mark.parametrize("sdpa_extends", [False, True])
def test_one_layer_over_a_float8_pool_equals_the_torch_backend(sdpa_extends):
    """The cpu backend's routing over a float8 pool on one layer of a real batch (decodes, short
    extends after a prefix in the per-token kernel reading the pool widened; long ones in the
    vdpbf16ps flash kernel, which widens the pool to bf16 as it packs, or without AVX512-BF16 in the
    per-token kernel too, or with ``sdpa_extends`` in SDPA): every row within bf16 rounding of the torch backend's over the same pool."""
    from kvledger.memory import KVBuffer
    from kvledger.model.attention import TorchAttention
    from kvledger.model.attention_cpu import CpuAttention
    from tests.helpers import mixed_layer_batch

    heads, kvh, d, bf16 = 9, 3, 64, torch.bfloat16
    torch.manual_seed(3)
    batch, pool = mixed_layer_batch(16)
    t = batch.num_tokens
    q = torch.randn(t, heads, d).to(bf16) * 2
    k, v = torch.randn(t, kvh, d).to(bf16), torch.randn(t, kvh, d).to(bf16)
    outs, routes = [], []
    for backend in (TorchAttention(heads, kvh, d), CpuAttention(heads, kvh, d, bf16, sdpa_extends=sdpa_extends)):
        backend.kv_dtype = F8
        if isinstance(backend, CpuAttention):
            backend.flash_amx = False  # the route off AMX, on any CPU (on AMX a float8 pool takes SDPA)
        torch.manual_seed(4)  # the same cached prefix K/V for both
        kv = KVBuffer(1, pool, kvh, d, F8)
        kv.k.copy_(to_cache(torch.randn(kv.k.shape), F8))
        kv.v.copy_(to_cache(torch.randn(kv.v.shape), F8))
        backend.prepare(batch)
        routes.append(batch.attn_meta)
        outs.append(backend.forward(0, q, k, v, kv, batch).float())
    meta = routes[1]
    assert meta.ext is not None  # short extends in the per-token kernel
    if sdpa_extends:
        assert meta.flash is None and meta.long_ext  # long ones in SDPA
    elif kernels.has_bf16_dot():
        assert meta.flash is not None and not meta.long_ext  # long ones in the flash kernel
    else:  # no AVX512-BF16: every extend in the per-token kernel, long ones too (never SDPA by default)
        assert meta.flash is None and not meta.long_ext
    torch.testing.assert_close(outs[1], outs[0], rtol=2**-6, atol=2**-6)
