"""GPT-OSS: attention with q/k/v/o biases and attention sinks (one learned logit per query head in
every softmax's denominator, no value: the backend's per-layer ``sinks``), sliding-window layers
alternating with full ones, YaRN rope, and top-k routed experts in every layer: a router with a bias
whose top-k logits are softmaxed, experts with biases and a clamped SwiGLU (``ClampedSwiGLU``).

The HF checkpoint stacks each layer's experts as ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (x @ W,
the gate and up columns interleaved: gate at even columns, up at odd ones) and ``down_proj``
``[E, I, H]``, with ``*_bias``; they are de-interleaved and transposed at load into ``MoE``'s
``[E, 2I, H]`` / ``[E, H, I]``. MXFP4 checkpoints (OpenAI's release: ``*_blocks``/``*_scales``,
``quantization_config.quant_method`` ``mxfp4``) are refused: serve a float (bf16/fp32) safetensors
checkpoint. No GGUF (llama.cpp's ``gpt-oss`` files hold MXFP4 experts) and no tensor parallelism
(the sinks and expert biases are not sharded)."""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..config import FULL, SLIDING, ModelConfig
from ..layers import Attention, ClampedSwiGLU, MoE
from ..quantized import Weight, dense
from .base import CausalNet, PreNormLayer
from .builder import Builder

# transformers' GptOssConfig defaults where a config.json leaves them out
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


class GptOssNet(CausalNet):
    model_types = ("gpt_oss",)
    supports_tp = False
    graph_safe = False  # layers/moe.py: each expert's rows are counted on the host

    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        quant = (raw.get("quantization_config") or {}).get("quant_method")
        if quant is not None:
            raise ModelLoadError(
                f"{cfg.name}: {quant} checkpoints of gpt_oss are not read (quantization_config "
                f"quant_method {quant!r}); serve a float (bf16/fp32) safetensors checkpoint"
            )
        if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
            cfg.rope_theta = DEFAULT_THETA
        if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
            cfg.rope_scaling = dict(DEFAULT_ROPE)
        cfg.attention_bias = bool(raw.get("attention_bias", True))
        cfg.num_experts = int(raw["num_local_experts"])
        cfg.num_experts_per_tok = int(raw["num_experts_per_tok"])
        cfg.moe_intermediate_size = cfg.intermediate_size
        cfg.norm_topk_prob = True  # unused: the router softmaxes its top-k logits
        cfg.sliding_window = raw.get("sliding_window")
        # transformers' default: layer 0 slides, then every other one
        cfg.layer_types = raw.get("layer_types") or [
            SLIDING if i % 2 == 0 else FULL for i in range(cfg.num_layers)
        ]
        cfg.extra = {
            "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
        }

    @classmethod
    def hf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        """Each layer's stacked experts in ``MoE``'s layout: gate rows then up rows (the checkpoint
        interleaves them by column), transposed to ``[E, out, in]``."""
        out: dict[str, Weight] = {}
        for name, t in weights.items():
            if name.endswith(("_blocks", "_scales")):
                raise ModelLoadError(f"{cfg.name}: {name} is an MXFP4 tensor; MXFP4 checkpoints are not read")
            if name.endswith("mlp.experts.gate_up_proj"):
                w = dense(t)
                out[name[: -len("_proj")]] = torch.cat((w[..., 0::2], w[..., 1::2]), dim=-1).transpose(1, 2)
            elif name.endswith("mlp.experts.gate_up_proj_bias"):
                b = dense(t)
                out[name.replace("gate_up_proj_bias", "gate_up_bias")] = torch.cat((b[..., 0::2], b[..., 1::2]), -1)
            elif name.endswith("mlp.experts.down_proj"):
                out[name[: -len("_proj")]] = dense(t).transpose(1, 2)
            elif name.endswith("mlp.experts.down_proj_bias"):
                out[name.replace("down_proj_bias", "down_bias")] = t
            else:
                out[name] = t
        return out

    @classmethod
    def build(cls, b: Builder) -> CausalNet:
        cfg = b.cfg
        embed, head = b.vocab_ends()
        norm = b.norm("model.norm.weight")
        rotary = b.rotary()
        glu = ClampedSwiGLU(cfg.extra["swiglu_alpha"], cfg.extra["swiglu_limit"])
        bias = cfg.attention_bias
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            attn = Attention(
                i,
                b.proj([a + "q_proj", a + "k_proj", a + "v_proj"], bias=bias),
                b.lin(b.take(a + "o_proj.weight"), b.take(a + "o_proj.bias") if bias else None),
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                rotary,
                b.handle,
                sinks=b.cast(b.take(a + "sinks")),
            )
            mlp = MoE(
                b.cast(b.take(m + "router.weight")),
                b.cast(b.take(m + "experts.gate_up")),
                b.cast(b.take(m + "experts.down")),
                cfg.num_experts_per_tok,
                router_bias=b.cast(b.take(m + "router.bias")),
                gate_up_bias=b.cast(b.take(m + "experts.gate_up_bias")),
                down_bias=b.cast(b.take(m + "experts.down_bias")),
                glu=glu,
                topk_softmax=True,
            )
            in_norm = b.norm(p + "input_layernorm.weight")
            layers.append(PreNormLayer(attn, mlp, in_norm, b.norm(p + "post_attention_layernorm.weight")))
        net = cls(cfg, embed, layers, norm, head, b.comm)
        net.rotary = rotary
        return net
