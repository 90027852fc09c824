"""Mixtral: Mistral's attention with top-k routed experts (renormalized top-k weights) in every
layer; its checkpoints name experts ``block_sparse_moe.experts.E.w1/w2/w3``.

GGUF: llama.cpp writes Mixtral as arch ``llama`` with ``llama.expert_count`` > 0 (the registry's
``GGUF_MOE_ARCHITECTURES``) and Qwen3-MoE's stacked expert tensors; its Llama converter permutes the
q/k rows (undone here), and the experts' width is ``feed_forward_length``."""

from __future__ import annotations

import re

from ..config import SLIDING, ModelConfig
from ..gguf_map import GGUFMeta, unpermute_attention
from ..quantized import Weight
from .qwen3_moe import Qwen3MoeNet

_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class MixtralNet(Qwen3MoeNet):
    model_types = ("mixtral",)
    qk_norm = False

    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        cfg.attention_bias = False
        cfg.qk_norm = False
        cfg.num_experts = int(raw["num_local_experts"])
        cfg.num_experts_per_tok = int(raw["num_experts_per_tok"])
        cfg.moe_intermediate_size = cfg.intermediate_size
        cfg.norm_topk_prob = True
        cfg.extra = {}
        if raw.get("sliding_window"):
            cfg.sliding_window = int(raw["sliding_window"])
            cfg.layer_types = [SLIDING] * cfg.num_layers

    @classmethod
    def gguf_config(cls, meta: GGUFMeta, cfg: ModelConfig) -> None:
        super().gguf_config(meta, cfg)
        cfg.moe_intermediate_size = cfg.intermediate_size

    @classmethod
    def gguf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        return super().gguf_weights(unpermute_attention(weights, cfg), cfg)

    @classmethod
    def hf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        out = {}
        for name, t in weights.items():
            name = name.replace(".block_sparse_moe.", ".mlp.")
            m = re.search(r"\.experts\.(\d+)\.(w[123])\.weight$", name)
            if m:
                name = name[: m.start(2)] + _EXPERT[m.group(2)] + ".weight"
            out[name] = t
        return out
