"""Each family llama.cpp defines, read from a GGUF written the way llama.cpp's converter
(convert_hf_to_gguf.py) writes it: its tensor names (gguf's own name map, not kvledger's table), its
metadata keys, its transforms (the Llama converter's q/k permutation, experts stacked into 3-D
tensors, Gemma's norms stored as 1 + w ...), and its choice of what to quantize (every matrix but the
router; norms stay F32). For F32, Q8_0 and Q4_1 files: the loaded weights equal the file's values
(dequantized blocks) with the converter's transforms undone, and fp32 greedy tokens equal
transformers' on those values (for the F32 file, the HF weights themselves). Adding a family: its
row in CONVERTERS (what its converter writes), beside its row in tests/unit/test_families.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvledger import Engine, ModelLoadError, kernels
from kvledger.model import load_model
from kvledger.model.gguf_map import permute_qk
from kvledger.model.models.registry import GGUF_ARCHITECTURES, family_for
from kvledger.model.quantized import dense
from tests.helpers import assert_idle_clean, hf_greedy
from tests.unit.test_families import GREEDY, F, S, build_family

A = gguf.MODEL_ARCH
PROMPT_LENGTHS = (5, 23)  # the longer one outgrows the tiny configs' windows (8, 12)


# -- what llama.cpp's converter writes ---------------------------------------------------------------


def text_model_keys(w: gguf.GGUFWriter, c: dict) -> None:
    """``TextModel.set_gguf_parameters``: the keys most families write from config.json."""
    rope = c.get("rope_parameters") or {}
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    if (theta := rope.get("full_attention", rope).get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if (n := c.get("num_local_experts") or c.get("num_experts")) is not None:
        w.add_expert_count(n)
    if (k := c.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(k)
    if c.get("head_dim") is not None:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])


def llama_keys(w: gguf.GGUFWriter, c: dict) -> None:
    """``LlamaModel``: also the vocabulary size and the rotary dimensions."""
    text_model_keys(w, c)
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def stack_experts(t: dict, c: dict, each: str, parts: tuple[str, ...], stacked: str) -> dict:
    """A layer's per-expert matrices (``each``: ``{bid}``, ``{xid}``, ``{w}``) stacked into one
    [experts, rows, cols] tensor per part (``stacked``), as the MoE converters do."""
    n = c.get("num_local_experts") or c.get("num_experts") or 0
    out = dict(t)
    for bid in range(c["num_hidden_layers"]):
        for w in parts:
            names = [each.format(bid=bid, xid=x, w=w) for x in range(n)]
            if n and names[0] in out:
                out[stacked.format(bid=bid, w=w)] = torch.stack([out.pop(m) for m in names])
    return out


def llama_tensors(t: dict, c: dict) -> dict:
    """``LlamaModel.modify_tensors``: q/k rows permuted for llama.cpp's rotary, Mixtral's experts stacked."""
    out = {}
    for name, x in t.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            x = permute_qk(x, c["num_attention_heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            x = permute_qk(x, c["num_key_value_heads"])
        out[name] = x
    return stack_experts(
        out, c, "model.layers.{bid}.block_sparse_moe.experts.{xid}.{w}.weight", ("w1", "w2", "w3"),
        "layers.{bid}.feed_forward.experts.{w}.weight",
    )  # fmt: skip


def gemma2_keys(w: gguf.GGUFWriter, c: dict) -> None:
    """``Gemma2Model``: its own keys (no rope base: llama.cpp's 10000), the soft-caps, the window."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])


def gemma3_keys(w: gguf.GGUFWriter, c: dict) -> None:
    """``Gemma3Model``: TextModel's keys (both rope bases), the final soft-cap where set, the window."""
    text_model_keys(w, c)
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if c.get("sliding_window_pattern") != 1:
        w.add_sliding_window(c["sliding_window"])


def phi3_keys(w: gguf.GGUFWriter, c: dict) -> None:
    """``Phi3MiniModel``: its own keys: the rotary dims of partial rotation, the window (0: none)."""
    rope = c.get("rope_parameters") or {}
    n_embd, n_head = c["hidden_size"], c["num_attention_heads"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.get("sliding_window") or 0)


def qwen3moe_keys(w: gguf.GGUFWriter, c: dict) -> None:
    """``Qwen2MoeModel``: TextModel's keys and the experts' width."""
    text_model_keys(w, c)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])


def qwen3moe_tensors(t: dict, c: dict) -> dict:
    """``Qwen2MoeModel.modify_tensors``: a layer's experts stacked per projection."""
    return stack_experts(
        t, c, "model.layers.{bid}.mlp.experts.{xid}.{w}.weight", ("down_proj", "gate_proj", "up_proj"),
        "model.layers.{bid}.mlp.experts.{w}.weight",
    )  # fmt: skip


def without_lm_head(t: dict, c: dict) -> dict:
    """Gemma 2's converter skips lm_head (tied)."""
    return {n: x for n, x in t.items() if n != "lm_head.weight"}


@dataclass(frozen=True)
class Converter:
    """What llama.cpp's converter does for one family (conversion/<family>.py in llama.cpp)."""

    arch: gguf.MODEL_ARCH
    model_type: str  # the kvledger family that serves the file
    keys: Callable[[gguf.GGUFWriter, dict], None]  # its set_gguf_parameters
    tensors: Callable[[dict, dict], dict] = lambda t, c: t  # its modify_tensors, in HF names
    settings: dict = field(default_factory=dict)  # over test_families' config: what a GGUF can say
    norm_offset: float = 0.0  # Gemma's converters store every norm weight as 1 + w


CONVERTERS: dict[str, Converter] = {
    # test_families' family: its converter. Mistral is written as arch llama, without its window.
    "mistral_window": Converter(A.LLAMA, "llama", llama_keys, llama_tensors, dict(sliding_window=None)),
    # a GGUF has no query_pre_attn_scalar (llama.cpp's is the head dim below the 27B) and no untied
    # head (the converter drops lm_head)
    "gemma2": Converter(
        A.GEMMA2, "gemma2", gemma2_keys, without_lm_head,
        dict(query_pre_attn_scalar=16, tie_word_embeddings=True), norm_offset=1.0,
    ),
    # llama.cpp's Gemma 3 slides on five layers of every six (the converter writes no pattern); a
    # local rope base off llama.cpp's default, so that reading its key counts
    "gemma3": Converter(
        A.GEMMA3, "gemma3_text", gemma3_keys,
        settings=dict(
            num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16,
            rope_parameters={F: dict(rope_type="default", rope_theta=1e6), S: dict(rope_type="default", rope_theta=100.0)},
        ),
        norm_offset=1.0,
    ),
    "phi3": Converter(A.PHI3, "phi3", phi3_keys),  # qkv_proj and gate_up_proj stay fused
    "olmo2": Converter(A.OLMO2, "olmo2", text_model_keys),
    # llama.cpp routes every layer and renormalizes the top-k weights of Qwen3-MoE
    "qwen3_moe": Converter(
        A.QWEN3MOE, "qwen3_moe", qwen3moe_keys, qwen3moe_tensors, dict(norm_topk_prob=True, mlp_only_layers=[])
    ),
    "mixtral": Converter(A.LLAMA, "mixtral", llama_keys, llama_tensors),  # arch llama with experts
}


def write_gguf(
    src: str, out: str, family: str, qtype: str = "F32", skip: tuple[str, ...] = (), conv: Converter | None = None
) -> None:
    """The HF model in ``src`` as llama.cpp's converter writes it (``qtype``: its --outtype);
    ``skip``: GGUF tensors left out; ``conv``: another converter than the family's."""
    conv = conv or CONVERTERS[family]
    c = json.loads(Path(src, "config.json").read_text())
    hf = load_file(str(Path(src, "model.safetensors")))
    hf = {n: x + conv.norm_offset if n.endswith("norm.weight") else x for n, x in hf.items()}
    names = gguf.get_tensor_name_map(conv.arch, c["num_hidden_layers"])
    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[conv.arch])
    conv.keys(w, c)
    for name, x in conv.tensors(hf, c).items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, f"llama.cpp names no {conv.arch.name} tensor {name}"
        if gname in skip:
            continue
        arr = np.ascontiguousarray(x.float().numpy())
        if qt != gguf.GGMLQuantizationType.F32 and _quantized(gname, arr.ndim):
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quantized(gguf_name: str, ndim: int) -> bool:
    """The converter's rule: matrices in the outtype, but norms, 1-D tensors and the router in F32."""
    return ndim >= 2 and not gguf_name.endswith("_norm.weight") and ".ffn_gate_inp." not in gguf_name


def file_values(src: str, family: str, qtype: str) -> dict[str, torch.Tensor]:
    """What the file holds, in HF names with the transforms undone: Gemma's norms as the converter
    rounded 1 + w, less 1; a quantized matrix's dequantized blocks (blocks run along rows, so
    quantizing before or after the permutations and the stacking gives the same blocks)."""
    conv = CONVERTERS[family]
    qt = gguf.GGMLQuantizationType[qtype]
    out = {}
    for name, x in load_file(str(Path(src, "model.safetensors"))).items():
        if conv.norm_offset and name.endswith("norm.weight"):
            x = (x + conv.norm_offset) - conv.norm_offset
        router = name.endswith(".gate.weight")  # mlp.gate / block_sparse_moe.gate
        if qt != gguf.GGMLQuantizationType.F32 and x.ndim >= 2 and "norm" not in name and not router:
            x = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), qt), qt).astype(np.float32))
        out[name] = x
    return out


# -- the checks ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(CONVERTERS))
def family_src(request, tmp_path_factory) -> tuple[str, str]:
    """The family's tiny model with norm weights moved off their init (so a wrong offset shows)."""
    family = request.param
    path = build_family(str(tmp_path_factory.mktemp(family)), family, **CONVERTERS[family].settings)
    st = Path(path, "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    t = load_file(str(st))
    for name, x in t.items():
        if "norm" in name:
            x += 0.2 * torch.randn(x.shape, generator=gen)
    save_file(t, str(st), metadata={"format": "pt"})
    return family, path


def _hf_refs(path: str, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """transformers' greedy tokens for ``prompts`` and the log-probability of the last one's first."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    refs = [hf_greedy(hf.eval(), p, GREEDY["max_new_tokens"]) for p in prompts]
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[-1]])).logits[0, -1].float()
    return refs, torch.log_softmax(logits, -1)[refs[-1][0]].item()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_family_gguf_matches_transformers(family_src, qtype, tmp_path):
    family, src = family_src
    conv = CONVERTERS[family]
    path = str(tmp_path / f"{family}-{qtype}.gguf")
    write_gguf(src, path, family, qtype)
    values = file_values(src, family, qtype)

    loaded = load_model(path, load_tokenizer=False)
    assert loaded.config.arch == conv.model_type
    fam = family_for(conv.model_type)
    expected = fam.hf_weights({n: v.clone() for n, v in values.items()}, loaded.config)
    assert sorted(loaded.weights) == sorted(expected)
    for name, ref in expected.items():
        assert torch.equal(dense(loaded.weights[name]), ref), name

    # the reference: transformers on the file's values (the HF weights themselves for F32)
    ref_dir = src
    if qtype != "F32":
        ref_dir = str(tmp_path / "ref")
        Path(ref_dir).mkdir()
        Path(ref_dir, "config.json").write_text(Path(src, "config.json").read_text())
        save_file(values, str(Path(ref_dir, "model.safetensors")), metadata={"format": "pt"})
    prompts = [[(7 * i + 3 * n) % 250 + 3 for i in range(n)] for n in PROMPT_LENGTHS]
    refs, first_logprob = _hf_refs(ref_dir, prompts)

    eng = Engine(
        path, dtype="float32", page_size=4, max_total_tokens=1024, chunked_prefill_size=16,
        enable_mixed_chunk=True, strict_memory=True,
    )  # fmt: skip
    outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "logprobs": True})
    for p, o, ref in zip(prompts, outs, refs):
        assert o["output_ids"] == ref, f"{family} {qtype}: prompt of {len(p)} tokens"
    assert abs(outs[-1]["meta_info"]["output_token_logprobs"][0][0] - first_logprob) < 1e-4
    assert_idle_clean(eng)
    eng.shutdown()

    if qtype != "F32" and kernels.load():  # served in its own precision: the kernels pack the file's blocks
        eng = Engine(path, dtype="bfloat16", max_total_tokens=1024, strict_memory=True)
        assert eng.core.model.quantization == ("int4" if qtype == "Q4_1" else "int8")
        out = eng.generate(input_ids=prompts[-1], sampling_params={**GREEDY, "max_new_tokens": 4})
        assert len(out["output_ids"]) == 4
        assert_idle_clean(eng)
        eng.shutdown()


def test_sliding_window_pattern_key(tmp_path):
    """llama.cpp's ``attention.sliding_window_pattern`` as one flag per layer wins over the family's
    period (Gemma 3's six)."""
    src = build_family(str(tmp_path / "hf"), "gemma3")  # 3 layers: sliding, full, sliding

    def keys(w, c):
        gemma3_keys(w, c)
        w.add_sliding_window_pattern([True, False, True])

    write_gguf(src, str(tmp_path / "g.gguf"), "gemma3", conv=Converter(A.GEMMA3, "gemma3_text", keys, norm_offset=1.0))
    cfg = load_model(str(tmp_path / "g.gguf")).config
    assert cfg.layer_windows() == [8, None, 8]
    assert cfg.rope_theta == 1e6


def test_phi3_longrope_is_refused(tmp_path):
    """A Phi-3 GGUF with longrope factors (the 128k models) is refused at start, as its HF checkpoint."""
    src = build_family(str(tmp_path / "hf"), "phi3")

    def keys(w, c):  # the converter's generate_extra_tensors for a long-context model
        phi3_keys(w, c)
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            w.add_tensor(name, np.ones(4, dtype=np.float32))

    path = str(tmp_path / "long.gguf")
    write_gguf(src, path, "phi3", conv=Converter(A.PHI3, "phi3", keys))
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'longrope'"):
        Engine(path, dtype="float32", max_total_tokens=256)


def test_missing_or_miscounted_experts_are_clear_errors(tmp_path):
    src = build_family(str(tmp_path / "hf"), "qwen3_moe", **CONVERTERS["qwen3_moe"].settings)
    path = str(tmp_path / "no-up.gguf")
    write_gguf(src, path, "qwen3_moe", "Q8_0", skip=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ModelLoadError, match=r"lacks blk\.1\.ffn_up_exps\.weight \(layer 1's experts\)"):
        load_model(path)

    def three(w, c):  # the metadata says 3 experts, the tensors hold 4
        qwen3moe_keys(w, {**c, "num_local_experts": 3, "num_experts": 3})

    path = str(tmp_path / "three.gguf")
    write_gguf(src, path, "qwen3_moe", conv=Converter(A.QWEN3MOE, "qwen3_moe", three, qwen3moe_tensors))
    with pytest.raises(ModelLoadError, match=r"ffn_\w+_exps\.weight holds 4 experts; the metadata says 3"):
        load_model(path)


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    path = str(tmp_path / "bloom.gguf")
    w = gguf.GGUFWriter(path, "bloom")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert "unsupported architecture 'bloom'" in msg and "\n" not in msg
    assert all(arch in msg for arch in GGUF_ARCHITECTURES)
