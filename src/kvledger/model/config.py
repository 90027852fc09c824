"""The model's shape, read from a HF config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

# model_type -> (qkv bias, per-head q/k RMSNorm)
SUPPORTED_ARCHS: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


@dataclass
class ModelConfig:
    """Everything the forward pass needs to know about a Llama-family model."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    name: str = "model"

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "model") -> ModelConfig:
        """Build from a config.json dict (transformers 4.x and 5.x spellings both accepted)."""
        from ..errors import ModelLoadError

        model_type = cfg.get("model_type", "?")
        if model_type not in SUPPORTED_ARCHS:
            archs = cfg.get("architectures") or [model_type]
            raise ModelLoadError(
                f"unsupported architecture {archs[0]!r} (model_type {model_type!r}); "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHS))}"
            )
        bias, qk_norm = SUPPORTED_ARCHS[model_type]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if rope and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        max_pos = cfg.get("max_position_embeddings", 4096)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        if window:
            # Full attention equals sliding-window attention only within the window: cap there.
            max_pos = min(max_pos, int(window))
        return cls(
            arch=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", bias)),
            qk_norm=qk_norm,
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            name=name,
        )
