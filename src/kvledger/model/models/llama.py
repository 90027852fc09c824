"""The Llama family: Llama, SmolLM, Mistral, Qwen2, Qwen3 (pre-norm decoder, SwiGLU, rotary;
Qwen2's QKV biases, Qwen3's per-head q/k norms, Mistral's sliding window), and the language models
of Qwen2-VL and Qwen2.5-VL (Qwen2's, with M-RoPE: ``mrope_section`` splits the rotary frequencies
over three positions a token, ``multimodal/mrope.py``; a forward where a row meets an image reads
them from ``layers/rotary.mrope_positions`` and runs the torch rotary; every other forward, the
decode steps' one kernel call included, turns each token at its one position, offset by its images').

The fast path of kvledger's default model: eager forwards with the ``cpu`` attention backend run
the norms, rotary and SiLU in the C++ kernels (``fused``), and a batch of decodes runs every layer
in one kernel call (``one_call.py``: ``decode_plan``/``decode_step``, each layer described by
``layer_desc``) where the layers are the kernel's packed projections.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Comm
from ...errors import ModelLoadError
from ..config import SLIDING, ModelConfig
from ..gguf_map import unpermute_attention
from ..layers import Attention, GatedMLP, LMHead, RMSNorm, Rotary, VocabEmbedding, rms_norm
from ..layers.rotary import current_mrope
from ..quantized import Weight
from .base import CausalNet, Projections
from .builder import Builder
from .one_call import ACTIVATIONS, QK_HEAD, QK_NONE, LayerDesc, LayerNorms, OneCallDecode

# model_type -> (qkv bias, per-head q/k RMSNorm)
VARIANTS: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "qwen2_vl_text": (True, False),
    "qwen2_5_vl_text": (True, False),
}


class LlamaLayer(Projections, nn.Module):
    def __init__(self, attn: Attention, mlp: GatedMLP, in_norm: torch.Tensor, post_norm: torch.Tensor):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        # raw weights: the C++ kernels take them as they are
        self.in_norm = nn.Parameter(in_norm, requires_grad=False)
        self.post_norm = nn.Parameter(post_norm, requires_grad=False)


class LlamaNet(OneCallDecode, CausalNet):
    model_types = tuple(VARIANTS)

    def __init__(
        self,
        cfg: ModelConfig,
        embed: VocabEmbedding,
        layers: list[LlamaLayer],
        norm: RMSNorm,
        lm_head: LMHead,
        comm: Comm,
        rotary: Rotary,
        fused: bool,
    ):
        """``fused``: eager forwards use kvledger's C++ norm/rotary/SiLU kernels (loaded)."""
        super().__init__(cfg, embed, layers, norm, lm_head, comm)
        self.rotary = rotary
        self.fused = fused
        self.mrope_section: list[int] | None = cfg.extra.get("mrope_section")

    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        bias, qk_norm = VARIANTS[cfg.arch]
        if cfg.arch.endswith("_vl_text"):  # M-RoPE: the sections; the frequencies are the default rope's
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            section = rope.get("mrope_section")
            if not section or sum(section) * 2 != cfg.head_dim:
                raise ModelLoadError(f"M-RoPE sections {section!r} do not cover head_dim {cfg.head_dim}")
            cfg.extra["mrope_section"] = [int(n) for n in section]
            if (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type")) in ("mrope", "default"):
                cfg.rope_scaling = None
        cfg.attention_bias = bool(raw.get("attention_bias", bias))
        cfg.qk_norm = qk_norm
        window = raw.get("sliding_window") if raw.get("use_sliding_window", cfg.arch == "mistral") else None
        if window:
            cfg.sliding_window = int(window)
            # Qwen2/3 slide from layer max_window_layers on (transformers 5 writes layer_types)
            first = int(raw.get("max_window_layers", 0)) if cfg.arch != "mistral" else 0
            cfg.layer_types = raw.get("layer_types") or [
                SLIDING if i >= first else "full_attention" for i in range(cfg.num_layers)
            ]

    @classmethod
    def gguf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        # llama.cpp's Llama converter (Llama, Mistral) permutes the q/k rows; Qwen2/3's does not
        if cfg.arch in ("llama", "mistral"):
            weights = unpermute_attention(weights, cfg)
        return super().gguf_weights(weights, cfg)

    @classmethod
    def build(cls, b: Builder) -> LlamaNet:
        cfg = b.cfg
        embed, head = b.vocab_ends()
        norm = b.norm("model.norm.weight")
        rotary = b.rotary()
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = b.attention(i, rotary, norms=cfg.qk_norm)
            mlp = b.gated_mlp(p + "mlp")
            in_norm = b.cast(b.take(p + "input_layernorm.weight"))
            layers.append(
                LlamaLayer(attn, mlp, in_norm, b.cast(b.take(p + "post_attention_layernorm.weight")))
            )
        # The C++ rotary kernel turns whole heads: partial rotation (Phi-4-mini) runs the torch ops.
        return cls(cfg, embed, layers, norm, head, b.comm, rotary, b.fused and rotary.rot_dim == cfg.head_dim)

    def layer_desc(self, i: int, layer: LlamaLayer) -> tuple[LayerDesc, LayerNorms] | None:
        """Llama's pre-norm layer: RMS norms of the model dtype, SiLU, Qwen3's per-head q/k norms,
        Mistral's and Qwen2/3's window where the layer slides."""
        attn = layer.attn
        act = ACTIVATIONS.get(layer.mlp.act_name)
        if act is None or (attn.q_norm is not None and (attn.qk_norm != "per_head" or attn.q_norm.gemma)):
            return None
        qk = attn.q_norm is not None
        desc = LayerDesc(qk_norm=QK_HEAD if qk else QK_NONE, act=act, window=self.cfg.layer_windows()[i] or 0)
        norms = LayerNorms(
            layer.in_norm,
            layer.post_norm,
            q=attn.q_norm.weight if qk else None,
            k=attn.k_norm.weight if qk else None,
        )
        return desc, norms

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The C++ kernels in eager forwards; a compiled graph keeps the torch ops (Inductor fuses them).
        mrope = current_mrope() if self.mrope_section is not None else None
        fused = self.fused and not torch.compiler.is_compiling() and mrope is None
        kops = torch.ops.kvledger_cpu if fused else None
        if mrope is not None:  # a row meets an image: three positions a token
            cs = self.rotary.lookup_sections(mrope, self.mrope_section)
        else:
            cs = None if fused else self.rotary.lookup(positions)
        comm = self.comm
        eps = self.cfg.rms_norm_eps
        h = self.embed(input_ids)

        def add_norm(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor):
            """``h + delta`` and its RMS norm; the kernel adds into ``h`` in place."""
            if fused:
                return h, kops.add_rms_norm(h, delta, w, eps)
            h = h + delta
            return h, rms_norm(h, w, eps)

        x = (
            kops.rms_norm(h, self.layers[0].in_norm, eps)
            if fused
            else rms_norm(h, self.layers[0].in_norm, eps)
        )
        n_layers = len(self.layers)
        for i, L in enumerate(self.layers):
            h, x = add_norm(h, comm.all_reduce(L.attn(x, positions, cs, kops)), L.post_norm)
            # SiLU and the product in the GEMMs' epilogues where the layer has the split AMX copy.
            act = L.mlp.gate_up.silu_gated(x) if fused else None
            if act is None and fused and L.mlp.act_name == "silu":
                act = kops.silu_mul(L.mlp.gate_up(x))
            elif act is None:
                g, u = L.mlp.gate_up(x).chunk(2, dim=-1)
                act = L.mlp.act(g) * u
            delta = comm.all_reduce(L.mlp.down(act))
            if i + 1 < n_layers:
                h, x = add_norm(h, delta, self.layers[i + 1].in_norm)
            else:
                h = h + delta
        return h
