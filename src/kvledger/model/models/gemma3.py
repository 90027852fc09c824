"""Gemma 3 (text): Gemma 2's layers with per-head q/k norms, no soft-capping by default, and a
second rope base (``rope_local_base_freq``) for its sliding layers (five of every six).

GGUF (llama.cpp's ``gemma3``): Gemma 2's names and 1 + w norms; the window (none: every layer full),
the final soft-cap and the sliding layers' rope base (``rope.freq_base_swa``, llama.cpp's default
10000) from its keys."""

from __future__ import annotations

from ..config import FULL, SLIDING, ModelConfig
from ..gguf_map import GGUFMeta, Keys
from .base import CausalNet
from .builder import Builder
from .gemma2 import Gemma2Net, gguf_query_scalar


class Gemma3Net(Gemma2Net):
    model_types = ("gemma3_text",)

    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        super().hf_config(raw, cfg)
        if not raw.get("layer_types"):  # transformers 4: every sliding_window_pattern-th layer is full
            every = int(raw.get("sliding_window_pattern", 6))
            cfg.layer_types = [FULL if (i + 1) % every == 0 else SLIDING for i in range(cfg.num_layers)]
        rope = raw.get("rope_parameters") or {}
        full, local = rope.get(FULL), rope.get(SLIDING)
        if full is not None:  # transformers 5: one rope per layer type
            cfg.rope_theta = float(full.get("rope_theta", cfg.rope_theta))
            cfg.rope_scaling = dict(full) if full.get("rope_type", "default") != "default" else None
        cfg.extra["rope_local_theta"] = float(
            (local or {}).get("rope_theta", raw.get("rope_local_base_freq", 10000.0))
        )

    @classmethod
    def gguf_config(cls, meta: GGUFMeta, cfg: ModelConfig) -> None:
        cfg.hidden_act = "gelu_pytorch_tanh"
        window = int(meta.get(Keys.Attention.SLIDING_WINDOW, 0) or 0)
        if window:  # five sliding layers, then a full one, unless the file says otherwise
            cfg.sliding_window = window
            cfg.layer_types = meta.sliding_layers(cfg.num_layers, every=6)
        cfg.extra = {
            "query_pre_attn_scalar": gguf_query_scalar(cfg, layers_27b=62),
            "attn_logit_softcapping": None,
            "final_logit_softcapping": float(meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0)) or None,
            "rope_local_theta": float(meta.get(Keys.Rope.FREQ_BASE_SWA, 10000.0)),
        }

    @classmethod
    def build(cls, b: Builder) -> CausalNet:
        return cls._build(b, qk_norm=True, local_theta=b.cfg.extra["rope_local_theta"])
