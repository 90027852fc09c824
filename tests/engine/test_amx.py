"""``--cpu-amx``: a quantized model's large calls (prefill chunks) in oneDNN's bf16 GEMM on a prepacked
copy of the kernel's own weights, and long extends' attention in torch's SDPA (both run on the AMX
tiles where the CPU has them). ``on`` takes the same calls on any CPU whose oneDNN has bf16 kernels,
so these tests run wherever that holds, AMX or not."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger import kernels
from kvledger.errors import ValidationError
from kvledger.model import linear
from kvledger.model.linear import AMX_MIN_ROWS, Linear, use_amx

needs_bf16_onednn = pytest.mark.skipif(
    not (kernels.load() and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="needs kvledger's CPU kernels and oneDNN with bf16 kernels",
)
CPU = torch.device("cpu")


def test_auto_takes_the_amx_paths_only_for_a_quantized_bf16_model_on_an_amx_cpu(monkeypatch):
    monkeypatch.setattr(linear, "amx_available", lambda: True)
    bf16_ok = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert use_amx("auto", CPU, torch.bfloat16, "int4") == bf16_ok
    assert not use_amx("auto", CPU, torch.bfloat16, None)  # dense bf16 layers run oneDNN already
    assert not use_amx("auto", CPU, torch.float32, "int4")
    assert not use_amx("auto", torch.device("meta"), torch.bfloat16, "int4")
    assert not use_amx("off", CPU, torch.bfloat16, "int4")
    monkeypatch.setattr(linear, "amx_available", lambda: False)
    assert not use_amx("auto", CPU, torch.bfloat16, "int8")
    assert use_amx("on", CPU, torch.bfloat16, "int8") == bf16_ok  # asked: the same calls without AMX


@needs_bf16_onednn
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_layer_takes_the_bf16_copy_from_amx_rows_and_the_kernel_below(mode):
    """Below ``amx_rows`` the kernel's output bit for bit; from it oneDNN's bf16 GEMM of the kernel's
    own weights (so the two differ only by the kernel's int8 activations), with the bias."""
    torch.manual_seed(2)
    w, b = torch.randn(96, 64) * 0.1, torch.randn(96)
    lin = Linear(w, b.bfloat16(), mode, dtype=torch.bfloat16, amx=True)
    assert lin.packed is not None and lin.qw is not None
    assert Linear(w, None, mode, dtype=torch.bfloat16).packed is None  # off unless asked
    for rows in (1, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, 200):
        x = torch.randn(rows, 64).bfloat16()
        y = lin(x)
        if rows < AMX_MIN_ROWS:
            tiles = kernels.has_amx() and rows >= linear.AMX_TILE_ROWS
            assert lin.path(rows) == ("tiles" if tiles else "kernel") and torch.equal(y, lin.qw(x) + lin.b)
            continue
        assert lin.path(rows) == "amx"
        ref = x.float() @ lin.qw.rows().T + b.bfloat16().float()
        assert torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.b, "none", [], ""))
        assert ((y.float() - ref).norm() / ref.norm()) < 0.01  # bf16 rounding only
    assert lin.packed_bytes() > lin.qw.nbytes()  # the copy is counted where weights are reported


@needs_bf16_onednn
def test_a_swiglu_mlp_takes_silu_and_the_product_in_the_gemm_epilogues():
    """A gated MLP's gate_up with the AMX copy holds it as gate and up halves; from amx_rows rows the
    MLP runs silu(gate) * up in oneDNN's post-ops (within bf16 rounding of the unfused product), below
    it the kernel as before, and an adapter on the layer takes the unfused path."""
    from kvledger.model.layers.mlp import GatedMLP

    torch.manual_seed(3)
    wgu, wd = torch.randn(256, 64) * 0.1, torch.randn(64, 128) * 0.1
    gate_up = Linear(wgu, None, "int4", dtype=torch.bfloat16, amx=True)
    mlp = GatedMLP(gate_up, Linear(wd, None, "int4", dtype=torch.bfloat16, amx=True))
    assert gate_up.gated is not None and gate_up.packed is None
    assert gate_up.packed_bytes() == gate_up.qw.nbytes() + 256 * 64 * 2  # the halves are counted
    w = gate_up.qw.rows()
    for rows in (AMX_MIN_ROWS - 1, AMX_MIN_ROWS, 300):
        x = torch.randn(rows, 64).bfloat16()
        act = gate_up.silu_gated(x)
        assert (act is None) == (rows < AMX_MIN_ROWS)
        if act is None:
            continue
        gu = x.float() @ w.T
        ref = torch.nn.functional.silu(gu[:, :128]) * gu[:, 128:]
        assert ((act.float() - ref).norm() / ref.norm()) < 0.01
        assert torch.equal(mlp(x), mlp.down(act))
    gate_up.lora = object()  # an adapter on the layer: its output needs gate_up's whole product
    assert gate_up.silu_gated(torch.randn(AMX_MIN_ROWS, 64).bfloat16()) is None


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


@needs_bf16_onednn
def test_prefills_run_in_the_bf16_copy_close_to_fp32_and_decodes_stay_one_call(make_engine):
    """With ``--cpu-amx on``: every projection keeps the copy; a prompt of ``AMX_MIN_ROWS`` tokens and
    more is one forward through it (counted on the first layer's qkv), its first token the same and its
    logprob within 0.05 of the kernel's (``off``: the same int4 weights, int8 activations); batches of fewer decodes still run in the one-call C++ decode.
    In float32, or without a quantization, ``on`` is refused before anything starts."""
    with pytest.raises(ValidationError, match="AMX paths"):
        make_engine(dtype="float32", cpu_amx="on")
    with pytest.raises(ValidationError, match="AMX paths"):
        make_engine(dtype="bfloat16", quantization="none", cpu_amx="on")
    ref = make_engine(dtype="bfloat16", quantization="int4", cpu_amx="off")
    assert ref.core.model.net.layers[0].attn.qkv.packed is None
    eng = make_engine(dtype="bfloat16", quantization="int4", cpu_amx="on")
    net = eng.core.model.net
    assert eng.core.model.amx and net.decode_plan is not None and net.decode_plan.max_rows == AMX_MIN_ROWS - 1
    qkv = net.layers[0].attn.qkv
    rows: list[tuple[int, str]] = []
    qkv.register_forward_pre_hook(lambda m, a: rows.append((a[0].shape[0], m.path(a[0].shape[0]))))
    p = {"max_new_tokens": 1, "temperature": 0, "logprobs": True}
    for i, n in enumerate((AMX_MIN_ROWS, 250, 300)):
        prompt = _prompt(n, i)
        a = ref.generate(input_ids=prompt, sampling_params=p)["meta_info"]["output_token_logprobs"][0]
        b = eng.generate(input_ids=prompt, sampling_params=p)["meta_info"]["output_token_logprobs"][0]
        assert a[1] == b[1] and abs(a[0] - b[0]) < 0.05, (a, b)
    assert rows == [(AMX_MIN_ROWS, "amx"), (250, "amx"), (300, "amx")]
    rows.clear()
    before = eng.core.model.one_call_forwards
    eng.generate(input_ids=[_prompt(20, 7), _prompt(30, 8)], sampling_params={"max_new_tokens": 8, "temperature": 0})
    # The prompts' one forward, below the threshold (on the tiles where the CPU has them); then one-call decodes.
    assert rows == [(50, "tiles" if kernels.has_amx() else "kernel")]
    assert eng.core.model.one_call_forwards > before


@needs_bf16_onednn
def test_long_extends_take_sdpa_and_short_ones_the_kernel(make_engine):
    """The cpu backend with the AMX paths: an extend of FLASH_MIN_NEW tokens or more (a prompt, or a
    chunk after a cached prefix) runs in SDPA, shorter ones in the per-token kernel; the output of a
    prompt and of its chunked twin agree with the float32 reference's first token."""
    from kvledger.model.attention_cpu import FLASH_MIN_NEW

    eng = make_engine(dtype="bfloat16", quantization="int4", cpu_amx="on", attention_backend="cpu")
    attn = eng.core.model.attn
    assert attn.sdpa_extends
    seen: list[tuple[int, int]] = []
    real = attn.prepare

    def prepare(batch):
        real(batch)
        meta = batch.attn_meta
        seen.append((len(meta.long_ext), 0 if meta.ext is None else len(meta.ext[0])))
        assert meta.flash is None

    attn.prepare = prepare
    g = {"max_new_tokens": 1, "temperature": 0}
    eng.generate(input_ids=_prompt(FLASH_MIN_NEW, 1), sampling_params=g)
    eng.generate(input_ids=_prompt(FLASH_MIN_NEW - 1, 2), sampling_params=g)
    assert seen == [(1, 0), (0, 1)]
    ref = make_engine(dtype="float32")
    chunked = make_engine(
        dtype="bfloat16", quantization="int4", cpu_amx="on", attention_backend="cpu", chunked_prefill_size=96
    )
    prompt = _prompt(250, 3)
    want = ref.generate(input_ids=prompt, sampling_params=g)["output_ids"]
    for e in (eng, chunked):  # 250 new tokens in one extend; 96 + 96 + 58 after their prefixes
        assert e.generate(input_ids=prompt, sampling_params=g)["output_ids"] == want


needs_amx_tiles = pytest.mark.skipif(
    not (kernels.load() and kernels.has_amx()),
    reason="the CPU has no AMX tiles (or Linux refused this process the tile state; qlinear_amx.cpp)",
)


@needs_amx_tiles
@pytest.mark.parametrize("bits", [4, 8])
def test_amx_tiles_compute_the_bf16_product_of_the_dequantized_weights(bits):
    """``quant_linear`` from ``amx_rows`` rows: the file's weights dequantized to bf16 (the AMX copy's
    values), float sums, one rounding to bf16: within one bf16 step of that product (the sums' order
    is the tiles'), whatever the rows' count against the 16-row tiles and the blocks' against their
    pairs (48 outputs: three blocks; 1,536 inputs: 48 groups). Below ``amx_rows`` the VNNI path's bits."""
    from kvledger.kernels.quant import pack

    ops = torch.ops.kvledger_cpu
    torch.manual_seed(5)
    for n, k in ((48, 64), (96, 576), (64, 1536)):
        pw = pack(torch.randn(n, k) * 0.05, bits)
        wb = pw.rows().bfloat16().double()
        for rows in (1, 15, 16, 17, 32, 33, 100):
            x = torch.randn(rows, k).bfloat16()
            y = ops.quant_linear(x, pw.w, pw.scales, pw.wsum128, bits, n, 1).float()
            ref = x.double() @ wb.T
            # One bf16 step at ref's magnitude, plus float sums' rounding where terms cancel to ~0.
            step = ref.abs() * 2**-7 + (x.double().abs() @ wb.abs().T) * 2**-20
            assert ((y - ref).abs() <= step).all(), (n, k, rows, ((y - ref).abs() / step).max())
            below = ops.quant_linear(x, pw.w, pw.scales, pw.wsum128, bits, n, rows + 1)
            assert torch.equal(below, ops.quant_linear(x, pw.w, pw.scales, pw.wsum128, bits, n, 0))


@needs_amx_tiles
def test_decodes_on_amx_tiles_in_one_call_equal_the_python_loop(make_engine, monkeypatch):
    """Batched decodes with the tiles (threshold lowered to 4 so a tiny model's batch of 6 takes them):
    ``decode_layers`` passes the layers' threshold to every projection, so the one-call decode and the
    Python loop compute the same tokens and logprobs bit for bit; a layer built without AMX keeps 0."""
    from kvledger.model import causal_lm

    monkeypatch.setattr(linear, "AMX_TILE_ROWS", 4)
    prompts = [_prompt(10 + 7 * i, 20 + i) for i in range(6)]
    g = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True}
    runs = {}
    for one_call in (False, True):
        monkeypatch.setattr(causal_lm, "DECODE_IN_ONE_CALL", one_call)
        eng = make_engine(dtype="bfloat16", quantization="int4", cpu_amx="on")
        net = eng.core.model.net
        assert net.decode_plan is not None and net.decode_plan.amx_rows == 4
        assert net.layers[0].attn.qkv.qw.amx_rows == 4
        outs = eng.generate(input_ids=prompts, sampling_params=g)
        runs[one_call] = [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]
        assert (eng.core.model.one_call_forwards > 0) == one_call
    assert runs[True] == runs[False]
    off = make_engine(dtype="bfloat16", quantization="int4", cpu_amx="off")
    assert off.core.model.net.layers[0].attn.qkv.qw.amx_rows == 0 and off.core.model.net.decode_plan.amx_rows == 0
