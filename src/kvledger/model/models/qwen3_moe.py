"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with top-k routed experts in place of the MLP
(dense MLPs on the ``mlp_only_layers`` and off the ``decoder_sparse_step``).

GGUF (llama.cpp's ``qwen3moe``): the router (``ffn_gate_inp``) and each layer's experts stacked in
three [experts, rows, cols] tensors (``ffn_{gate,up,down}_exps``), which the loader cuts into one
matrix per expert (a quantized file's blocks kept as they are; the MoE layer runs dense, so they are
dequantized to the model dtype at build); expert counts and width from its keys. llama.cpp routes every
layer and always renormalizes the top-k weights, and so does a model read from its file."""

from __future__ import annotations

from typing import ClassVar

from ...errors import ModelLoadError
from ..config import ModelConfig
from ..gguf_map import DECODER, EXPERTS, GGUFMeta, Keys, gguf_name
from ..layers import MoE
from ..quantized import Weight
from .base import CausalNet, PreNormLayer
from .builder import Builder, stack_experts


class Qwen3MoeNet(CausalNet):
    model_types = ("qwen3_moe",)
    qk_norm = True
    gguf_tensors: ClassVar[dict] = {**DECODER, **EXPERTS}
    graph_safe = False  # layers/moe.py: each expert's rows are counted on the host

    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        cfg.attention_bias = bool(raw.get("attention_bias", False))
        cfg.qk_norm = cls.qk_norm
        cfg.num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        cfg.num_experts_per_tok = int(raw["num_experts_per_tok"])
        cfg.moe_intermediate_size = int(raw.get("moe_intermediate_size") or cfg.intermediate_size)
        cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
        cfg.extra = {
            "decoder_sparse_step": int(raw.get("decoder_sparse_step", 1)),
            "mlp_only_layers": list(raw.get("mlp_only_layers") or []),
        }
        if raw.get("use_sliding_window") and raw.get("sliding_window"):
            raise_unsupported_window(cfg)

    @classmethod
    def gguf_config(cls, meta: GGUFMeta, cfg: ModelConfig) -> None:
        cfg.qk_norm = cls.qk_norm
        cfg.num_experts = int(meta.need(Keys.LLM.EXPERT_COUNT))
        cfg.num_experts_per_tok = int(meta.need(Keys.LLM.EXPERT_USED_COUNT))
        width = meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)  # llama.cpp's default: n_ff / experts used
        cfg.moe_intermediate_size = int(width or cfg.intermediate_size // cfg.num_experts_per_tok)
        cfg.norm_topk_prob = True
        cfg.extra = {}  # every layer routed

    @classmethod
    def gguf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        """Every routed layer's router and experts present, or the file's missing tensor named."""
        for i in range(cfg.num_layers):
            if not cls.is_moe_layer(cfg, i):
                continue
            for tensor, hf in EXPERTS.items():
                if hf.format(bid=i, xid=0) + ".weight" not in weights:
                    raise ModelLoadError(f"{cfg.name}: the GGUF lacks {gguf_name(tensor, i)} (layer {i}'s experts)")
        return super().gguf_weights(weights, cfg)

    @classmethod
    def is_moe_layer(cls, cfg: ModelConfig, i: int) -> bool:
        step = cfg.extra.get("decoder_sparse_step", 1)
        return cfg.num_experts > 0 and i not in cfg.extra.get("mlp_only_layers", []) and (i + 1) % step == 0

    @classmethod
    def build(cls, b: Builder) -> CausalNet:
        cfg = b.cfg
        embed, head = b.vocab_ends()
        norm = b.norm("model.norm.weight")
        rotary = b.rotary()
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = b.attention(i, rotary, norms=cfg.qk_norm)
            if cls.is_moe_layer(cfg, i):
                gate_up, down = stack_experts(b, p + "mlp.experts", cfg.num_experts)
                router = b.cast(b.take(p + "mlp.gate.weight"))
                mlp = MoE(router, gate_up, down, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act)
            else:
                mlp = b.gated_mlp(p + "mlp")
            in_norm = b.norm(p + "input_layernorm.weight")
            layers.append(PreNormLayer(attn, mlp, in_norm, b.norm(p + "post_attention_layernorm.weight")))
        net = cls(cfg, embed, layers, norm, head, b.comm)
        net.rotary = rotary
        return net


def raise_unsupported_window(cfg: ModelConfig) -> None:
    from ...errors import ModelLoadError

    raise ModelLoadError(f"{cfg.arch}: use_sliding_window is not supported for this family")
