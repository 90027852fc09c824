"""A GGUF's Q4_1 / Q8_0 matrices stay the file's blocks from the loader to the kernel: the packed
layers equal those packed from the dequantized weights (the old path), the embedding is looked up in
the tied LM head's blocks, no dense copy is kept where the kernel serves every call, and the default
model's weights stay within 1.3x its file (issue 29)."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from kvledger import Engine, kernels
from kvledger.kernels.gguf_weight import GgufWeight
from kvledger.kernels.quant import PackedWeight, pack, pack_blocks
from kvledger.model import LlamaModel, load_model
from kvledger.model import linear as linear_mod
from kvledger.model.linear import Linear
from kvledger.model.quantized import BLOCK_KINDS, BlockStack, BlockWeight, cat_rows, dense
from kvledger.parallel.shard import shard_weights
from tests.helpers import assert_idle_clean, build_tiny_model
from tests.unit.test_gguf_linear import random_blocks
from tests.unit.test_loader import write_gguf

needs_kernels = pytest.mark.skipif(not kernels.load(), reason="kvledger's C++ kernels did not build here")


def _blocks(kind: str, rows: int, cols: int, seed: int = 0) -> BlockWeight:
    arr = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data = gguf.quants.quantize(arr, gguf.GGMLQuantizationType[kind])
    return BlockWeight.from_gguf(kind, data)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_block_selections_equal_the_same_selections_of_the_dense_weight(kind):
    bw = _blocks(kind, 48, 128)
    w = bw.dequantize()
    raw = bw.raw.reshape(48, -1)
    assert torch.equal(w, torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])))
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    assert torch.equal(bw.rows(perm).dequantize(), w[perm])
    assert torch.equal(bw.rows(slice(16, 40)).dequantize(), w[16:40])
    assert torch.equal(bw.cols(slice(32, 96)).dequantize(), w[:, 32:96])
    assert bw.cols(slice(16, 96)) is None  # not on block boundaries: the caller dequantizes
    other = _blocks(kind, 16, 128, seed=2)
    assert torch.equal(cat_rows([bw, other]).dequantize(), torch.cat([w, other.dequantize()]))
    assert torch.equal(cat_rows([bw, w[:8]]), torch.cat([w, w[:8]]))  # mixed: dense
    padded = bw.pad_rows(64).dequantize()
    assert torch.equal(padded[:48], w) and not padded[48:].any()


@pytest.mark.parametrize("kind", [k for k in BLOCK_KINDS if k not in ("Q4_1", "Q8_0")])
def test_selections_of_every_kind_are_whole_blocks_of_the_dense_weight(kind):
    cols = 512
    bw = BlockWeight.from_gguf(kind, random_blocks(kind, 48, cols, np.random.default_rng(4)))
    b = bw.block
    assert bw.shape == (48, cols) and bw.nbytes() == bw.raw.size
    w = bw.dequantize()
    ref = gguf.quants.dequantize(bw.raw.reshape(48, -1), gguf.GGMLQuantizationType[kind])
    assert torch.equal(w, torch.from_numpy(ref))
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    assert torch.equal(bw.rows(perm).dequantize(), w[perm])
    assert torch.equal(bw.cols(slice(b, 2 * b)).dequantize(), w[:, b : 2 * b])
    assert bw.cols(slice(b // 2, 2 * b)) is None
    padded = bw.pad_rows(64).dequantize()
    assert torch.equal(padded[:48], w) and not padded[48:].any()
    other = BlockWeight.from_gguf("Q8_0", random_blocks("Q8_0", 16, cols, np.random.default_rng(5)))
    stack = cat_rows([bw, other])  # two kinds: kept as blocks, each in its own
    assert isinstance(stack, BlockStack) and stack.shape == (64, cols)
    assert torch.equal(stack.dequantize(), torch.cat([w, other.dequantize()]))


@needs_kernels
def test_a_kind_served_as_stored_keeps_the_files_bytes_and_no_dense_copy(monkeypatch):
    monkeypatch.setattr(linear_mod, "REPACK", False)  # the as-stored path (Q4_K/Q6_K repack: below)
    raw = random_blocks("Q6_K", 40, 512, np.random.default_rng(6))
    bw = BlockWeight.from_gguf("Q6_K", raw)
    lin = Linear(bw, None, "int4", dtype=torch.bfloat16)
    assert isinstance(lin.qw, GgufWeight) and lin.w is None and lin.packed is None and not lin.qw.packed
    assert lin.qw.w.data_ptr() == raw.ctypes.data  # a view of the file's bytes, not a copy
    assert lin.packed_bytes() == raw.size
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    assert torch.equal(lin(x), torch.ops.kvledger_cpu.gguf_linear(x, torch.from_numpy(raw), 14, 40, 512))
    ids = torch.tensor([0, 39, 7, 7])
    assert torch.equal(lin.qw.rows(ids), bw.dequantize()[ids])  # the tied embedding's lookups
    lin.unpack()
    assert torch.equal(lin.w, bw.dequantize().to(torch.bfloat16))


@needs_kernels
@pytest.mark.skipif(kernels.quant_isa() != "avx512-vnni", reason="the repack is only made for the VNNI kernel")
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_a_repacked_kind_keeps_the_files_values_at_its_size(kind):
    """Q4_K/Q6_K repacked at load (GgufWeight.repack): the file's bits in another order, whole groups of
    16 rows (40 rows -> 48 here; Q4_K 148 bytes a row and super-block for 144); the outputs the tiles'
    path's on the file's blocks at every batch, the rows and the dense copy the file's values."""
    raw = random_blocks(kind, 40, 512, np.random.default_rng(6))
    bw = BlockWeight.from_gguf(kind, raw)
    lin = Linear(bw, None, "int4", dtype=torch.bfloat16)
    assert isinstance(lin.qw, GgufWeight) and lin.qw.packed and lin.w is None and lin.packed is None
    assert lin.packed_bytes() == 48 * 2 * (148 if kind == "Q4_K" else 210)
    tid = int(gguf.GGMLQuantizationType[kind])
    for m in (1, 3, 9):
        x = torch.randn(m, 512, dtype=torch.bfloat16)
        assert torch.equal(lin(x), torch.ops.kvledger_cpu.gguf_linear(x, torch.from_numpy(raw), tid, 40, 512, None, 1))
    ids = torch.tensor([0, 39, 7, 7])
    assert torch.equal(lin.qw.rows(ids), bw.dequantize()[ids])  # the tied embedding's lookups
    lin.unpack()
    assert torch.equal(lin.w, bw.dequantize().to(torch.bfloat16))


@needs_kernels
def test_a_fused_projection_of_mixed_kinds_runs_each_part_in_its_own_kind():
    rng = np.random.default_rng(8)
    parts = [BlockWeight.from_gguf(k, random_blocks(k, r, 256, rng)) for k, r in
             (("Q5_0", 32), ("Q5_0", 16), ("Q8_0", 16), ("Q6_K", 8))]  # fmt: skip
    fused = Linear(cat_rows(parts), None, "int4", dtype=torch.bfloat16)
    assert isinstance(fused.qw, GgufWeight)
    # Repacked, the two Q5_0 parts are one run (the first whole groups of 16 rows: the same bytes), as a
    # fused tensor of one kind is; as stored, each part stays its own.
    runs = [("Q5_0", 48), ("Q8_0", 16), ("Q6_K", 8)] if fused.qw.packed else [(p.kind, p.shape[0]) for p in parts]
    assert list(fused.qw.parts) == runs
    for m in (1, 5, 9):  # 9: gguf_linear's tiles' path (a tile never spans two parts)
        x = torch.randn(m, 256)
        alone = []
        for p in parts:  # each part alone, repacked where the stack's part is (the same sums either way)
            single = GgufWeight(((p.kind, p.shape[0]),), 256, torch.from_numpy(p.raw))
            if fused.qw.packed:
                single.repack()
            alone.append(single(x))
        assert torch.equal(fused.qw(x), torch.cat(alone, 1))
    assert torch.equal(fused.qw.rows(), torch.cat([p.dequantize() for p in parts]))


@needs_kernels
def test_deterministic_gguf_blocks_keep_a_rows_output_whatever_the_batch():
    """--enable-deterministic-inference: ``tile_rows=0`` (the rows' path at any batch), so a row's output
    is the same bits alone and among 9; by default 9 rows take the tiles' path (another float order)."""
    rng = np.random.default_rng(9)
    bw = BlockWeight.from_gguf("Q5_1", random_blocks("Q5_1", 48, 512, rng))  # a kind not repacked
    det = Linear(bw, None, "int4", dtype=torch.bfloat16, deterministic=True)
    plain = Linear(bw, None, "int4", dtype=torch.bfloat16)
    assert isinstance(det.qw, GgufWeight) and det.qw.tile_rows == 0 and plain.qw.tile_rows == -1
    x = torch.randn(9, 512)
    alone = torch.cat([det.qw(x[i : i + 1]) for i in range(9)])
    assert torch.equal(det.qw(x), alone)
    assert not torch.equal(plain.qw(x), alone)


@needs_kernels
def test_a_mixed_kquant_gguf_decodes_in_one_call_as_layer_by_layer(tmp_path):
    """A Q4_K_M-like file (q/k Q5_0, v Q8_0, o and gate/up Q4_K, down Q6_K): every projection served
    from its blocks, the one-call decode taking them (a stacked qkv included), token for token what
    the per-layer path gives with the same kernels."""
    src = build_tiny_model(
        str(tmp_path / "hf"), "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    path = str(tmp_path / "tiny-mixed.gguf")
    kinds = {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "down_proj": "Q6_K", "embed": "Q8_0"}
    write_gguf(src, path, "Q4_K", kinds=kinds, kd=0.0005)
    eng = Engine(path, dtype="bfloat16", page_size=16, max_total_tokens=1024, strict_memory=True)
    net = eng.core.model.net
    lins = [m for m in net.modules() if isinstance(m, Linear)]
    served = [m for m in lins if isinstance(m.qw, GgufWeight)]
    # 2 layers' 4 projections and the Q4_K LM head
    assert len(served) == 4 * 2 + 1 and all(m.w is None and m.packed is None for m in served)
    plan = net.decode_plan
    assert plan is not None and sum(b < 0 for b in plan.args[3]) == 8
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 9, 33, 7], [100, 3], [17]]
    one_call = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert eng.core.model.one_call_forwards > 0
    net.__dict__["decode_plan"] = None  # the cached plan away: the per-layer path
    layered = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert one_call == layered and [len(o) for o in one_call] == [10, 10, 10]  # no request failed
    # the Q4_K head served greedy rows in C++ (head_argmax on its blocks): the logits path's tokens
    assert net.lm_head.greedy_in_kernel(1)
    net.lm_head.greedy_in_kernel = lambda rows: False
    logits = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert logits == one_call
    assert_idle_clean(eng)
    eng.shutdown()


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_blocks_pack_exactly_as_their_dequantized_weights_would(kind):
    bw = _blocks(kind, 64, 96)
    bits = bw.bits
    direct = pack_blocks(*bw.codes(), bits=bits)
    via_float = pack(bw.dequantize(), bits)  # the path before issue 29: dequantize, quantize again
    assert torch.equal(direct.w, via_float.w) and torch.equal(direct.scales, via_float.scales)
    if bits == 8:
        assert torch.equal(direct.wsum128, via_float.wsum128)
    ids = torch.tensor([0, 63, 17, 17, 5])
    assert torch.equal(direct.rows(ids), bw.dequantize()[ids])
    assert torch.equal(direct.rows(), bw.dequantize())


@needs_kernels
def test_a_layer_the_kernel_serves_keeps_no_dense_copy_until_compile_asks():
    bw = _blocks("Q4_1", 64, 96)
    lin = Linear(bw, None, "int4", dtype=torch.bfloat16)
    assert lin.qw is not None and lin.w is None and lin.packed is None
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    assert torch.equal(lin(x), lin.qw(x))
    lin.unpack()  # torch.compile's graph runs the bf16 GEMM on the dequantized weights
    assert torch.equal(lin.w, bw.dequantize().to(torch.bfloat16))
    dense_lin = Linear(bw, None, None, dtype=torch.float32)  # no quantization: a dense float weight
    assert dense_lin.qw is None and torch.equal(dense_lin.w, bw.dequantize())


@needs_kernels
def test_a_q4_1_gguf_serves_from_its_blocks_token_for_token_as_from_dense_weights(tmp_path):
    src = build_tiny_model(str(tmp_path / "hf"), "llama", hidden_size=64, intermediate_size=128)
    path = str(tmp_path / "tiny-Q4_1.gguf")
    write_gguf(src, path, "Q4_1")
    loaded = load_model(path)
    assert isinstance(loaded.weights["model.layers.0.self_attn.q_proj.weight"], BlockWeight)
    densified = loaded.__class__(
        loaded.config, {k: dense(v) for k, v in loaded.weights.items()}, None, path, loaded.stored_quantization
    )
    outs = []
    for lm in (loaded, densified):
        eng = Engine(loaded_model=lm, dtype="bfloat16", page_size=16, max_total_tokens=1024, strict_memory=True)
        assert eng.core.cfg.model.quantization == "int4"
        lins = [m for m in eng.core.model.net.modules() if isinstance(m, Linear)]
        assert all(m.qw is not None and m.w is None for m in lins)
        out = eng.generate(
            input_ids=[[5, 9, 33, 7], [100, 3]],
            sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        outs.append([o["output_ids"] for o in out])
        assert_idle_clean(eng)
        eng.shutdown()
    assert outs[0] == outs[1]


def test_tensor_parallel_shards_of_blocks_are_the_shards_of_the_dense_weights(tmp_path):
    src = build_tiny_model(str(tmp_path / "hf"), "llama", hidden_size=64, intermediate_size=128)
    path = str(tmp_path / "tiny-Q8_0.gguf")
    write_gguf(src, path, "Q8_0")
    loaded = load_model(path)
    dense_w = {k: dense(v) for k, v in loaded.weights.items()}
    for rank in range(2):
        blocks = shard_weights(loaded.config, dict(loaded.weights), rank, 2)
        ref = shard_weights(loaded.config, dict(dense_w), rank, 2)
        assert set(blocks) == set(ref)
        for name, t in blocks.items():
            assert torch.equal(dense(t), ref[name]), name
        assert isinstance(blocks["model.layers.0.self_attn.o_proj.weight"], BlockWeight)  # cut on blocks


@pytest.mark.smollm2
@needs_kernels
def test_the_default_model_keeps_its_files_blocks_within_1_3x_the_file():
    loaded = load_model(None, load_tokenizer=False)
    file_bytes = os.path.getsize(loaded.path)
    embed_blocks = loaded.weights["model.embed_tokens.weight"]
    assert isinstance(embed_blocks, BlockWeight) and embed_blocks.kind == "Q8_0"
    ids = torch.tensor([0, 1, 2, 504, 49151, 12345])
    ref_embed = embed_blocks.dequantize()[ids].to(torch.bfloat16)
    sample = {n: loaded.weights[n] for n in ("model.layers.7.mlp.down_proj.weight",)}
    model = LlamaModel(loaded.config, dict(loaded.weights), dtype=torch.bfloat16, quantization="int4")
    assert model.weight_bytes() <= 1.3 * file_bytes, (model.weight_bytes(), file_bytes)
    net = model.net
    # one copy, tied: the Q8_0 blocks repacked where the CPU has the repack's kernel, else the int8 copy
    repacked = kernels.quant_isa() == "avx512-vnni" and linear_mod.REPACK
    assert isinstance(net.embed.weight, GgufWeight if repacked else PackedWeight)
    assert net.embed.weight is net.lm_head.linear.qw
    assert torch.equal(net.embed(ids), ref_embed)  # the file's values, as a dense table would give
    lins = [m for m in net.modules() if isinstance(m, Linear)]
    assert all(m.qw is not None and m.w is None and m.packed is None for m in lins)
    down = net.layers[7].mlp.down.qw
    via_float = pack(sample["model.layers.7.mlp.down_proj.weight"].dequantize(), 4)
    assert torch.equal(down.w, via_float.w) and torch.equal(down.scales, via_float.scales)


@needs_kernels
def test_an_untied_kquant_embedding_stays_the_files_blocks(tmp_path, monkeypatch):
    """A Q4_K_M file's untied Q4_K token table is kept as its blocks (rows dequantized as looked up),
    not a bfloat16 copy (the Llama-shape 1.2B: 54 MiB against 192): the same tokens as with the copy,
    and counted in the weights held."""
    from kvledger.model.models.builder import Builder

    src = build_tiny_model(
        str(tmp_path / "hf"), "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    path = str(tmp_path / "tiny-emb.gguf")
    write_gguf(src, path, "Q4_K", kinds={"embed": "Q4_K", "down_proj": "Q6_K"}, kd=0.0005)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 9, 33, 7] * 20, [100, 3], [17]]
    outs, held = [], []
    for blocks in (True, False):
        if not blocks:
            monkeypatch.setattr(Builder, "_embed_table", lambda self, raw: self.cast(raw))
        eng = Engine(path, dtype="bfloat16", page_size=16, max_total_tokens=1024)
        emb = eng.core.model.net.embed.weight
        assert isinstance(emb, GgufWeight) == blocks
        held.append(eng.core.model.weight_bytes())
        outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)])
        assert_idle_clean(eng)
        eng.shutdown()
    assert outs[0] == outs[1] and all(len(o) == 8 for o in outs[0])
    vocab, hidden = 256, 256
    assert held[1] - held[0] == vocab * hidden * 2 - vocab * hidden // 256 * 144  # bf16 table - Q4_K blocks
