"""The defaults that make kvledger fast on a CPU: the C++ kernels under ``--attention-backend auto``
and a quantized GGUF served in its own precision under ``--quantization auto``."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger import kernels
from kvledger.engine.resources import resolve_quantization
from kvledger.errors import ModelLoadError
from kvledger.model.attention_cpu import resolve_backend
from kvledger.model.linear import INT8_BATCH_ROWS

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": True}
needs_kernels = pytest.mark.skipif(not kernels.load(), reason=f"CPU kernels unavailable: {kernels.status()}")


def _prompts(n: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(5, 90))] for _ in range(n)]


@needs_kernels
def test_auto_picks_the_kernels_for_bf16_and_torch_for_the_fp32_reference():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.bfloat16) == "cpu"
    assert resolve_backend("auto", cpu, torch.float32) == "torch"
    assert resolve_backend("cpu", cpu, torch.float32) == "cpu"
    assert resolve_backend("torch", cpu, torch.bfloat16) == "torch"
    with pytest.raises(ModelLoadError, match="runs on CPUs"):
        resolve_backend("cpu", torch.device("meta"), torch.bfloat16)
    with pytest.raises(ModelLoadError, match="must be one of"):
        resolve_backend("flash", cpu, torch.bfloat16)


def test_without_the_kernels_auto_falls_back_and_cpu_says_why(monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda: False)
    monkeypatch.setitem(kernels._state, "reason", "build failed: no compiler")
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.bfloat16) == "torch"
    with pytest.raises(ModelLoadError, match="no compiler"):
        resolve_backend("cpu", cpu, torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("page_size", [1, 16])
def test_bf16_kernels_agree_with_the_torch_backend(make_engine, page_size):
    """bf16 on the kernels vs bf16 on torch ops, the same mixed workload (chunked prefill sharing
    forwards with decodes): chosen-token logprobs within 0.05 (measured: ~0.01), greedy tokens
    equal until a near-tie (here: all of them on at least 6 of 8 prompts)."""
    prompts = _prompts(8)
    outs = {}
    for backend in ("torch", "cpu"):
        eng = make_engine(
            dtype="bfloat16",
            attention_backend=backend,
            page_size=page_size,
            chunked_prefill_size=40,
            enable_mixed_chunk=True,
        )
        assert eng.core.model.attention == backend
        outs[backend] = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    _assert_agree(outs["torch"], outs["cpu"], min_same=6)


def _assert_agree(outs_a: list[dict], outs_b: list[dict], min_same: int) -> None:
    """Chosen-token logprobs within 0.05 up to each pair's first differing token, and at least
    ``min_same`` outputs equal throughout."""
    same = 0
    for a, b in zip(outs_a, outs_b):
        n = next(
            (i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y),
            len(a["output_ids"]),
        )
        same += n == len(a["output_ids"])
        lp_a = [t[0] for t in a["meta_info"]["output_token_logprobs"][:n]]
        lp_b = [t[0] for t in b["meta_info"]["output_token_logprobs"][:n]]
        assert max((abs(x - y) for x, y in zip(lp_a, lp_b)), default=0.0) < 0.05
    assert same >= min_same, same


def test_quantization_auto_serves_the_file_in_its_own_precision():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert resolve_quantization("auto", bf16, "cpu", "int4") == "int4"
    assert resolve_quantization("auto", bf16, "cpu", "int8") == "int8"
    assert resolve_quantization("auto", bf16, "cuda", "int4") is None  # CPU kernels: bf16 on a GPU
    assert resolve_quantization("auto", bf16, "cpu", None) is None  # a float checkpoint stays float
    assert resolve_quantization("auto", fp32, "cpu", "int4") is None  # fp32: the reference path
    assert resolve_quantization("none", bf16, "cpu", "int4") is None
    assert resolve_quantization(None, bf16, "cpu", "int4") is None
    assert resolve_quantization("int8", bf16, "cpu", "int4") == "int8"


def test_the_shipped_gguf_reads_as_int4_and_a_float_checkpoint_as_none(tiny_loaded):
    import gguf

    from kvledger.model.loader import default_model_path, stored_quantization

    reader = gguf.GGUFReader(default_model_path())
    assert stored_quantization([(t.name, t.tensor_type.name, len(t.shape)) for t in reader.tensors]) == "int4"
    assert tiny_loaded.stored_quantization is None  # safetensors in fp32


def test_default_engine_on_a_float_checkpoint_is_bf16_without_quantization(make_engine):
    eng = make_engine(dtype="auto", quantization="auto")
    if torch.float32 == eng.core.dtype:  # a CPU without native bf16: auto is float32
        assert eng.core.cfg.model.quantization is None
        return
    assert eng.core.cfg.model.quantization is None and eng.core.info.dtype == "bfloat16"
    eng.generate(input_ids=_prompts(2), sampling_params=GREEDY)


@needs_kernels
def test_int8_batch_runs_prefill_in_int8_close_to_fp32_and_needs_a_quantized_mode(make_engine):
    """--enable-int8-batch: prompts of INT8_BATCH_ROWS tokens and more go through the int8
    linear (counted on the first layer), the chosen first token's logprob stays within 0.1 of fp32;
    decode batches of 6 (below INT8_VNNI_ROWS) stay on the kernel; without a quantization, or in float32, the flag is refused
    before anything starts."""
    from kvledger.errors import ValidationError

    with pytest.raises(ValidationError, match="need a quantized mode"):
        make_engine(dtype="bfloat16", quantization="none", enable_int8_batch=True)
    with pytest.raises(ValidationError, match="need a quantized mode"):
        make_engine(dtype="float32", quantization="int8", enable_int8_batch=True)
    ref = make_engine(dtype="float32")
    eng = make_engine(dtype="bfloat16", quantization="int8", enable_int8_batch=True)
    qkv = eng.core.model.net.layers[0].attn.qkv
    assert qkv.w8 is not None
    calls = []
    real = qkv.w8
    qkv.w8 = lambda x, b=None: calls.append(x.shape[0]) or real(x, b)
    p = {"max_new_tokens": 1, "temperature": 0, "logprobs": True}
    rng = random.Random(3)
    for n in (INT8_BATCH_ROWS, 150, 200, 260):
        prompt = [rng.randrange(3, 250) for _ in range(n)]
        a = ref.generate(input_ids=prompt, sampling_params=p)["meta_info"]["output_token_logprobs"][0]
        b = eng.generate(input_ids=prompt, sampling_params=p)["meta_info"]["output_token_logprobs"][0]
        assert a[1] == b[1] and abs(a[0] - b[0]) < 0.1, (a, b)
    assert sorted(calls) == [INT8_BATCH_ROWS, 150, 200, 260]  # each prompt's one forward
    calls.clear()
    prompts = _prompts(6)  # one prefill forward of them all, then 23 decode steps of 6 rows
    eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert calls == [sum(map(len, prompts))]


@pytest.fixture(scope="module")
def tiny_hd64(tmp_path_factory):
    """A tiny Llama with SmolLM2's head_dim (64) and GQA ratio (3): the bf16 flash kernel's shapes."""
    from kvledger.model import load_model
    from tests.helpers import build_tiny_model

    path = build_tiny_model(
        str(tmp_path_factory.mktemp("tiny_hd64")),
        "llama",
        seed=4,
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
    )
    return load_model(path)


@needs_kernels
@pytest.mark.skipif(not (kernels.load() and kernels.has_bf16_dot()), reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("page_size", [1, 16])
def test_long_prompts_take_the_flash_kernel_and_agree_with_the_torch_backend(tiny_hd64, page_size):
    """Prompts of 70-400 tokens in chunks of 160 (so later chunks run over a cached prefix), decodes
    sharing the forwards: extends of >= FLASH_MIN_NEW tokens go through flash_attention_ (counted),
    shorter ones through extend_attention_, the output agrees with the torch backend in bf16 and the
    ledger is clean. (This tiny model's logits are flat, so agreement here checks the plumbing; the
    numbers are checked per layer below and per kernel in tests/unit/test_cpu_kernels.py.)"""
    from kvledger import Engine
    from kvledger.model.attention_cpu import FLASH_MIN_NEW
    from tests.helpers import assert_idle_clean

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(70, 400))] for _ in range(6)]
    prompts.append([*prompts[0][:90], 7, 8, 9])  # a cached prefix, then a short extend
    outs, flash_calls = {}, []
    for backend in ("torch", "cpu"):
        eng = Engine(
            loaded_model=tiny_hd64,
            dtype="bfloat16",
            attention_backend=backend,
            page_size=page_size,
            chunked_prefill_size=160,
            enable_mixed_chunk=True,
            max_total_tokens=8192,
            strict_memory=True,
        )
        attn = eng.core.model.attn
        if backend == "cpu":
            assert attn.flash
            real = attn.flash_op
            attn.flash_op = lambda out, q, *a, real=real: (  # a: k, v, table, rows, starts, prefix, lens, ...
                flash_calls.append(a[6].tolist()) or real(out, q, *a)
            )
        outs[backend] = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_idle_clean(eng)
    news = [n for call in flash_calls for n in call]
    assert news and min(news) >= FLASH_MIN_NEW, news
    _assert_agree(outs["torch"], outs["cpu"], min_same=5)


@needs_kernels
@pytest.mark.parametrize("page_size", [1, 16])
def test_one_layer_of_a_mixed_batch_equals_the_torch_backend(page_size):
    """The cpu backend's routing on one attention layer of a real batch (decodes, short extends after
    a prefix, long extends with and without one: per-token kernel, flash kernel where the CPU has
    AVX512-BF16, decode kernel): every row within bf16 rounding of the torch backend's."""
    from kvledger.memory import KVBuffer
    from kvledger.model.attention import TorchAttention
    from kvledger.model.attention_cpu import CpuAttention
    from tests.helpers import mixed_layer_batch

    heads, kvh, d, bf16 = 9, 3, 64, torch.bfloat16
    torch.manual_seed(3)
    batch, pool = mixed_layer_batch(page_size)
    t = batch.num_tokens
    q = torch.randn(t, heads, d).to(bf16) * 2
    k, v = torch.randn(t, kvh, d).to(bf16), torch.randn(t, kvh, d).to(bf16)
    outs = []
    for backend in (TorchAttention(heads, kvh, d), CpuAttention(heads, kvh, d, bf16)):
        torch.manual_seed(4)  # the same cached prefix K/V for both
        kv = KVBuffer(1, pool, kvh, d, bf16)
        kv.k.normal_()
        kv.v.normal_()
        backend.prepare(batch)
        outs.append(backend.forward(0, q, k, v, kv, batch).float())
    torch.testing.assert_close(outs[1], outs[0], rtol=2**-6, atol=2**-6)


@needs_kernels
@pytest.mark.parametrize("page_size,int8_batch", [(1, False), (16, False), (16, True)])
def test_decodes_in_one_kernel_call_equal_the_python_loop(make_engine, monkeypatch, page_size, int8_batch):
    """``kvledger_cpu::decode_layers`` runs every layer of a batch of decodes in one call: the same
    ops in the same order as the Python loop, so the same tokens and logprobs bit for bit. Batches
    with a prefill chunk beside the decodes keep the loop. With ``--enable-int8-batch`` on kvledger's
    VNNI int8 kernel, batches of ``INT8_VNNI_ROWS`` decodes and more run the int8 copies in the call
    (14 prompts: such batches, then smaller ones as requests end), as the loop's layers do."""
    from kvledger.model import causal_lm as llama
    from kvledger.model.linear import INT8_VNNI_ROWS

    runs = {}
    for one_call in (False, True):
        monkeypatch.setattr(llama, "DECODE_IN_ONE_CALL", one_call)
        eng = make_engine(
            dtype="bfloat16", quantization="int4", page_size=page_size, chunked_prefill_size=32,
            enable_int8_batch=int8_batch,
        )  # fmt: skip
        plan = eng.core.model.net.decode_plan
        vnni = int8_batch and eng.core.model.net.layers[0].attn.qkv.w8.vnni
        assert plan.int8_rows == (INT8_VNNI_ROWS if vnni else 0)
        if int8_batch and not vnni:
            # (oneDNN's int8 route, an AMX CPU's, stays outside the one-call decode)
            pytest.skip("the CPU has AMX tiles: the int8 copies run in the call only on kvledger's VNNI kernel")
        outs = eng.generate(input_ids=_prompts(14 if int8_batch else 6), sampling_params=GREEDY)
        one = eng.generate(input_ids=_prompts(1, seed=3)[0], sampling_params=GREEDY)  # a single stream
        runs[one_call] = [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in [*outs, one]]
        assert (eng.core.model.one_call_forwards > 0) == one_call
        assert eng.core.model.net.decode_plan is not None
    assert runs[True] == runs[False]


@needs_kernels
def test_one_call_decodes_only_where_the_layers_allow(make_engine, monkeypatch):
    """fp32 (no packed projections): the Python loop; with ``--enable-int8-batch`` on kvledger's VNNI
    int8 kernel every decode batch (the call takes the int8 copies from their threshold), on oneDNN's
    int8 linear only up to the rows where each projection stays on the kernel: by default every
    decode batch the engine allows, here with the thresholds lowered to 5 the loop for 6 decodes. (The
    AMX copy off: it has a threshold of its own, tests/engine/test_amx.py.)"""
    from kvledger.model import linear

    eng = make_engine()  # float32: the reference path
    eng.generate(input_ids=_prompts(2), sampling_params=GREEDY)
    assert eng.core.model.net.decode_plan is None and eng.core.model.one_call_forwards == 0
    eng = make_engine(dtype="bfloat16", quantization="int4", enable_int8_batch=True, cpu_amx="off")
    vnni = eng.core.model.net.layers[0].attn.qkv.w8.vnni
    plan = eng.core.model.net.decode_plan
    assert plan.max_rows == (1 << 62 if vnni else INT8_BATCH_ROWS - 1)
    eng.generate(input_ids=_prompts(6), sampling_params=GREEDY)
    assert eng.core.model.one_call_forwards > 0
    monkeypatch.setattr(linear, "INT8_BATCH_ROWS", 5)
    monkeypatch.setattr(linear, "INT8_VNNI_ROWS", 5)
    eng = make_engine(dtype="bfloat16", quantization="int4", enable_int8_batch=True, cpu_amx="off")
    plan = eng.core.model.net.decode_plan
    assert plan is not None and plan.max_rows == (1 << 62 if vnni else 4)
    assert plan.int8_rows == (5 if vnni else 0)
    eng.generate(input_ids=_prompts(6), sampling_params=GREEDY)  # decode batches of 6
    assert (eng.core.model.one_call_forwards > 0) == vnni  # in the call on int8 copies, or the loop
    eng.generate(input_ids=_prompts(2), sampling_params=GREEDY)
    assert eng.core.model.one_call_forwards > 0
