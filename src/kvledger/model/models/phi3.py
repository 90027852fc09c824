"""Phi-3: the Llama layer with fused ``qkv_proj`` and ``gate_up_proj`` tensors in the checkpoint
(split here into Llama's names, so tensor parallelism shards them as Llama's), partial rotary, and a
sliding window on every layer where the config sets one."""

from __future__ import annotations

from ..config import SLIDING, ModelConfig
from ..quantized import Weight
from .llama import LlamaNet


class Phi3Net(LlamaNet):
    model_types = ("phi3",)

    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        cfg.attention_bias = False
        cfg.qk_norm = False
        if raw.get("sliding_window"):
            cfg.sliding_window = int(raw["sliding_window"])
            cfg.layer_types = [SLIDING] * cfg.num_layers

    @classmethod
    def hf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        out = {}
        for name, t in weights.items():
            if name.endswith("self_attn.qkv_proj.weight"):
                p = name[: -len("qkv_proj.weight")]
                out[p + "q_proj.weight"], out[p + "k_proj.weight"] = t[:q], t[q : q + kv]
                out[p + "v_proj.weight"] = t[q + kv :]
            elif name.endswith("mlp.gate_up_proj.weight"):
                p = name[: -len("gate_up_proj.weight")]
                half = t.shape[0] // 2
                out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t[:half], t[half:]
            else:
                out[name] = t
        return out
