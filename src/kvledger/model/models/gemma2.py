"""Gemma 2: GeGLU, Gemma's (1 + w) RMS norms before and after both the attention and the MLP,
the embedding scaled by sqrt(hidden), scores scaled by ``query_pre_attn_scalar ** -0.5`` and
soft-capped, the logits soft-capped, and sliding-window attention on alternating layers.

GGUF (llama.cpp's ``gemma2``): its converter stores every norm weight as ``1 + w`` (undone here), has
the pre/post norms under their own names, writes the soft-caps and the window, and has no key for
``query_pre_attn_scalar`` (llama.cpp's rule stands in: ``gguf_query_scalar``)."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import nn

from ..attention_context import paged_attention
from ..config import FULL, SLIDING, ModelConfig
from ..gguf_map import DECODER, GGUFMeta, Keys, T
from ..layers import Attention, GatedMLP, RMSNorm
from ..quantized import Weight, dense
from .base import CausalNet, Projections
from .builder import Builder
from .one_call import ACTIVATIONS, NORM_GEMMA, QK_HEAD, QK_NONE, LayerDesc, LayerNorms, OneCallDecode


class GemmaLayer(Projections, nn.Module):
    """Pre and post norms around both blocks: ``h += post(block(pre(h)))``."""

    def __init__(self, attn: Attention, mlp: GatedMLP, norms: list[RMSNorm]):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.in_norm, self.post_attn_norm, self.pre_mlp_norm, self.post_mlp_norm = norms

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cs, comm) -> torch.Tensor:
        h = h + self.post_attn_norm(comm.all_reduce(self.attn(self.in_norm(h), positions, cs)))
        return h + self.post_mlp_norm(comm.all_reduce(self.mlp(self.pre_mlp_norm(h))))


LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def gguf_query_scalar(cfg: ModelConfig, layers_27b: int) -> int:
    """What a GGUF has no key for: llama.cpp takes ``query_pre_attn_scalar`` to be the head dim, except
    for the 27B (known by its layer count), whose is hidden / heads (gemma_pytorch's configs)."""
    return cfg.hidden_size // cfg.num_heads if cfg.num_layers == layers_27b else cfg.head_dim


class Gemma2Net(OneCallDecode, CausalNet):
    model_types = ("gemma2",)
    gguf_tensors: ClassVar[dict] = {
        **DECODER,
        T.ATTN_POST_NORM: "model.layers.{bid}.post_attention_layernorm",
        T.FFN_NORM: "model.layers.{bid}.pre_feedforward_layernorm",
        T.FFN_POST_NORM: "model.layers.{bid}.post_feedforward_layernorm",
    }

    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        cfg.tie_word_embeddings = bool(raw.get("tie_word_embeddings", True))
        cfg.attention_bias = bool(raw.get("attention_bias", False))
        cfg.sliding_window = raw.get("sliding_window")
        # transformers 4 had no layer_types: layer 0 slides, then every other one
        cfg.layer_types = raw.get("layer_types") or [
            SLIDING if i % 2 == 0 else FULL for i in range(cfg.num_layers)
        ]
        cfg.extra = {
            "query_pre_attn_scalar": raw.get("query_pre_attn_scalar") or cfg.head_dim,
            "attn_logit_softcapping": raw.get("attn_logit_softcapping"),
            "final_logit_softcapping": raw.get("final_logit_softcapping"),
        }

    @classmethod
    def gguf_config(cls, meta: GGUFMeta, cfg: ModelConfig) -> None:
        cfg.hidden_act = "gelu_pytorch_tanh"
        cfg.sliding_window = int(meta.get(Keys.Attention.SLIDING_WINDOW, 4096))  # llama.cpp's default
        cfg.layer_types = meta.sliding_layers(cfg.num_layers, every=2)  # layer 0 slides, then every other one
        cfg.extra = {
            "query_pre_attn_scalar": gguf_query_scalar(cfg, layers_27b=46),
            "attn_logit_softcapping": float(meta.get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, 50.0)),
            "final_logit_softcapping": float(meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 30.0)),
        }

    @classmethod
    def gguf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        # the converter wrote 1 + w (llama.cpp's norm multiplies by the weight as it is); float32's
        # 1 + w - 1 is exact, so this is the file's value, as llama.cpp uses it, less one
        weights = {n: dense(w) - 1.0 if n.endswith("norm.weight") else w for n, w in weights.items()}
        return super().gguf_weights(weights, cfg)

    @classmethod
    def attention_scale(cls, cfg: ModelConfig) -> float:
        return float(cfg.extra["query_pre_attn_scalar"]) ** -0.5

    @classmethod
    def attention_softcap(cls, cfg: ModelConfig) -> float | None:
        return cfg.extra.get("attn_logit_softcapping")

    @classmethod
    def build(cls, b: Builder) -> CausalNet:
        return cls._build(b, qk_norm=False, local_theta=None)

    @classmethod
    def _build(cls, b: Builder, qk_norm: bool, local_theta: float | None) -> CausalNet:
        """Gemma 2 and 3 differ by Gemma 3's q/k norms and its rope base of the sliding layers."""
        cfg = b.cfg
        embed, head = b.vocab_ends(
            embed_scale=cfg.hidden_size**0.5, softcap=cfg.extra.get("final_logit_softcapping")
        )
        norm = b.norm("model.norm.weight", gemma=True)
        rotary = b.rotary()
        local = rotary if local_theta is None else b.rotary(theta=local_theta, scaling=None)
        windows = cfg.layer_windows()
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = b.attention(i, local if windows[i] is not None else rotary, norms=qk_norm, gemma=True)
            mlp = b.gated_mlp(p + "mlp")
            layers.append(GemmaLayer(attn, mlp, [b.norm(p + n + ".weight", gemma=True) for n in LAYER_NORMS]))
        net = cls(cfg, embed, layers, norm, head, b.comm)
        net.rotary, net.local_rotary = rotary, local
        net.fused = b.fused  # the cpu backend with the kernels loaded: the one-call decode may run
        return net

    def rope_tables(self) -> list:
        return [self.rotary] if self.local_rotary is self.rotary else [self.rotary, self.local_rotary]

    def layer_desc(self, i: int, layer: GemmaLayer) -> tuple[LayerDesc, LayerNorms] | None:
        """Gemma's sandwich: ``(1 + w)`` norms in float32 before and after both blocks, GeGLU, Gemma 3's
        per-head q/k norms, the local rotary table and the window on the sliding layers. (Gemma 2's
        attention soft-cap keeps the Python loop: ``decode_plan`` checks the family's.)"""
        attn = layer.attn
        act = ACTIVATIONS.get(layer.mlp.act_name)
        norms = [layer.in_norm, layer.post_attn_norm, layer.pre_mlp_norm, layer.post_mlp_norm]
        qk = attn.q_norm is not None
        if qk:
            if attn.qk_norm != "per_head":
                return None
            norms += [attn.q_norm, attn.k_norm]
        if act is None or not all(n.gemma for n in norms):
            return None
        rope = int(attn.rotary is self.local_rotary and self.local_rotary is not self.rotary)
        desc = LayerDesc(
            NORM_GEMMA, True, QK_HEAD if qk else QK_NONE, act, rope, self.cfg.layer_windows()[i] or 0
        )
        w = [n.weight for n in norms] + [None, None]
        return desc, LayerNorms(w[0], w[2], post_attn=w[1], post_ffn=w[3], q=w[4], k=w[5])

    @functools.cached_property
    def eager_descs(self) -> list[tuple[LayerDesc, LayerNorms]] | None:
        """Each layer's description where eager forwards run the one-call step's C++ pieces (norms in
        place on the fused rows, the rotary kernel, the gated activation: ``kvledger_cpu.kind_norm`` and
        its siblings), else None (the torch modules): with the kernels loaded (``fused``), every layer
        described and the rotary over whole heads."""
        if not self.fused or any(r.rot_dim != self.cfg.head_dim for r in self.rope_tables()):
            return None
        descs = [self.layer_desc(i, L) for i, L in enumerate(self.layers)]
        return None if any(d is None for d in descs) else descs

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        descs = self.eager_descs
        if descs is not None and not torch.compiler.is_compiling():
            return self._hidden_fused(input_ids, positions, descs)
        h = self.embed(input_ids)
        cs = self.rotary.lookup(positions)
        cs_local = cs if self.local_rotary is self.rotary else self.local_rotary.lookup(positions)
        for L in self.layers:
            h = L(h, positions, cs_local if L.attn.rotary is self.local_rotary else cs, self.comm)
        return h

    def _hidden_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, descs: list) -> torch.Tensor:
        """``hidden`` in the order of the one-call decode (csrc/decode_step.cpp), each piece one C++ call
        on the kernels' thread pool: no float32 copies of the rows in torch between the projections (the
        torch modules' Gemma norms cost more than the projections at 1,024 prompt tokens), and a prompt's
        rows computed as its decodes are."""
        kops = torch.ops.kvledger_cpu
        eps, comm = self.cfg.rms_norm_eps, self.comm
        h = self.embed(input_ids).contiguous()
        rows = h.shape[0]
        d0, n0 = descs[0]
        x = kops.kind_norm(h, n0.pre_attn, d0.norm, eps)
        for i, (L, (d, n)) in enumerate(zip(self.layers, descs)):
            attn = L.attn
            heads, kvh, hd = attn.heads, attn.kv_heads, attn.head_dim
            qs, ks = attn.q_size, attn.kv_size
            qkv = attn.qkv(x)
            if n.q is not None:  # Gemma 3: each head of q, then of k, in place before the rotary
                kops.kind_head_norm_(qkv, 0, heads, hd, n.q, d.norm, eps)
                kops.kind_head_norm_(qkv, qs, kvh, hd, n.k, d.norm, eps)
            rot = attn.rotary
            kops.rope_(qkv[:, : qs + ks].view(rows, heads + kvh, hd), positions, rot.cos, rot.sin)
            q = qkv[:, :qs].view(rows, heads, hd)
            k = qkv[:, qs : qs + ks].view(rows, kvh, hd)
            v = qkv[:, qs + ks :].view(rows, kvh, hd)
            a = comm.all_reduce(attn.o(paged_attention(q, k, v, attn.layer_id, attn.handle)))
            x = kops.add_kind_norm(h, kops.kind_norm(a, n.post_attn, d.norm, eps), n.pre_ffn, d.norm, eps)
            dn = comm.all_reduce(L.mlp.down(kops.gated_act(L.mlp.gate_up(x), d.act)))
            dn = kops.kind_norm(dn, n.post_ffn, d.norm, eps)
            if i + 1 < len(descs):
                dn_next, n_next = descs[i + 1]
                x = kops.add_kind_norm(h, dn, n_next.pre_attn, dn_next.norm, eps)
            else:
                h.add_(dn)
        return h
