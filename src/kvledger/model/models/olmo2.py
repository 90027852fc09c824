"""OLMo 2: norms after each block instead of before (``h += post_norm(block(h))``), and q/k RMS
norms over the whole projection (before the split into heads). Those norms span every head, so
tensor parallelism (which splits the heads) is refused.

GGUF (llama.cpp's ``olmo2``): the post-norms under llama.cpp's post-norm names, nothing transformed.
A file with a sliding window is OLMo 3's layout, which this family does not serve (refused)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ...errors import ModelLoadError
from ..config import ModelConfig
from ..gguf_map import DECODER, GGUFMeta, Keys, T
from ..layers import Attention, GatedMLP, RMSNorm
from .base import CausalNet, Projections
from .builder import Builder
from .one_call import ACTIVATIONS, QK_FULL, LayerDesc, LayerNorms, OneCallDecode


class Olmo2Layer(Projections, nn.Module):
    def __init__(self, attn: Attention, mlp: GatedMLP, post_attn_norm: RMSNorm, post_mlp_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.post_attn_norm, self.post_mlp_norm = post_attn_norm, post_mlp_norm

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cs) -> torch.Tensor:
        h = h + self.post_attn_norm(self.attn(h, positions, cs))
        return h + self.post_mlp_norm(self.mlp(h))


class Olmo2Net(OneCallDecode, CausalNet):
    model_types = ("olmo2",)
    supports_tp = False
    gguf_tensors: ClassVar[dict] = {
        **{t: name for t, name in DECODER.items() if t not in (T.ATTN_NORM, T.FFN_NORM)},
        T.ATTN_POST_NORM: "model.layers.{bid}.post_attention_layernorm",
        T.FFN_POST_NORM: "model.layers.{bid}.post_feedforward_layernorm",
    }

    @classmethod
    def hf_config(cls, raw, cfg) -> None:
        cfg.attention_bias = bool(raw.get("attention_bias", False))
        cfg.qk_norm = True

    @classmethod
    def gguf_config(cls, meta: GGUFMeta, cfg: ModelConfig) -> None:
        cfg.qk_norm = True
        if meta.get(Keys.Attention.SLIDING_WINDOW):
            raise ModelLoadError(
                f"{cfg.name}: an olmo2 GGUF with a sliding window (OLMo 3's layout) is not supported"
            )

    @classmethod
    def build(cls, b: Builder) -> CausalNet:
        cfg = b.cfg
        embed, head = b.vocab_ends()
        norm = b.norm("model.norm.weight")
        rotary = b.rotary()
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = b.attention(i, rotary, norms=True, qk_norm="full")
            mlp = b.gated_mlp(p + "mlp")
            post = [
                b.norm(p + n + ".weight") for n in ("post_attention_layernorm", "post_feedforward_layernorm")
            ]
            layers.append(Olmo2Layer(attn, mlp, *post))
        net = cls(cfg, embed, layers, norm, head, b.comm)
        net.rotary = rotary
        net.fused = b.fused  # the cpu backend with the kernels loaded: the one-call decode may run
        return net

    def layer_desc(self, i: int, layer: Olmo2Layer) -> tuple[LayerDesc, LayerNorms] | None:
        """Norms after the blocks only, q/k norms over the whole projections, SiLU."""
        attn, act = layer.attn, ACTIVATIONS.get(layer.mlp.act_name)
        norms = [layer.post_attn_norm, layer.post_mlp_norm, attn.q_norm, attn.k_norm]
        if act is None or attn.qk_norm != "full" or any(n is None or n.gemma for n in norms):
            return None
        desc = LayerDesc(post_norms=True, qk_norm=QK_FULL, act=act, pre_norms=False)
        w = [n.weight for n in norms]
        return desc, LayerNorms(None, None, post_attn=w[0], post_ffn=w[1], q=w[2], k=w[3])

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        cs = self.rotary.lookup(positions)
        for L in self.layers:
            h = L(h, positions, cs)
        return h
