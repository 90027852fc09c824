"""Phi-3: the Llama layer with fused ``qkv_proj`` and ``gate_up_proj`` tensors in the checkpoint
(split here into Llama's names, so tensor parallelism shards them as Llama's), partial rotary, and a
sliding window on every layer where the config sets one.

GGUF (llama.cpp's ``phi3``): the fused tensors as they are (``attn_qkv``, and ``ffn_up`` holding the
gate rows then the up rows), split here as the HF ones; the rotary dims and the window from its keys.
llama.cpp itself disables Phi-3's window; kvledger keeps it, as transformers does. A file with
longrope factors (``rope_factors_long``) is refused, as the HF checkpoint is."""

from __future__ import annotations

from typing import ClassVar

from ..config import SLIDING, ModelConfig
from ..gguf_map import DECODER, GGUFMeta, Keys, T
from ..quantized import Weight, select_rows
from .llama import LlamaNet


class Phi3Net(LlamaNet):
    model_types = ("phi3",)
    gguf_tensors: ClassVar[dict] = {
        **{t: name for t, name in DECODER.items() if t is not T.FFN_GATE},
        T.ATTN_QKV: "model.layers.{bid}.self_attn.qkv_proj",
        T.FFN_UP: "model.layers.{bid}.mlp.gate_up_proj",
    }

    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        cfg.attention_bias = False
        cfg.qk_norm = False
        if raw.get("sliding_window"):
            cfg.sliding_window = int(raw["sliding_window"])
            cfg.layer_types = [SLIDING] * cfg.num_layers

    @classmethod
    def gguf_config(cls, meta: GGUFMeta, cfg: ModelConfig) -> None:
        window = int(meta.get(Keys.Attention.SLIDING_WINDOW, 0) or 0)  # the converter writes 0 for none
        if window:
            cfg.sliding_window = window
            cfg.layer_types = [SLIDING] * cfg.num_layers
        if "rope_factors_long.weight" in meta.tensor_names:
            cfg.rope_scaling = {"rope_type": "longrope"}  # refused when the rotary tables are built

    @classmethod
    def hf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        out = {}
        for name, t in weights.items():
            if name.endswith("self_attn.qkv_proj.weight"):
                p = name[: -len("qkv_proj.weight")]
                out[p + "q_proj.weight"] = select_rows(t, slice(0, q))
                out[p + "k_proj.weight"] = select_rows(t, slice(q, q + kv))
                out[p + "v_proj.weight"] = select_rows(t, slice(q + kv, None))
            elif name.endswith("mlp.gate_up_proj.weight"):
                p = name[: -len("gate_up_proj.weight")]
                half = t.shape[0] // 2
                out[p + "gate_proj.weight"] = select_rows(t, slice(0, half))
                out[p + "up_proj.weight"] = select_rows(t, slice(half, None))
            else:
                out[name] = t
        return out
