"""The model's shape, read from a HF config.json or from GGUF metadata.

The fields every family shares are read here; a family's own settings (soft-capping, a second rope
base, its MoE layout) are read by its class (``models/``: ``hf_config``) into ``extra`` and the MoE
fields. Which ``model_type`` is which family is the registry's table (``models/registry.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass
class ModelConfig:
    """Everything the forward pass needs to know about a model (this rank's shapes under TP)."""

    arch: str  # HF model_type: the registry's key
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
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None  # the window of the layers whose layer_types entry is SLIDING
    layer_types: list[str] | None = None  # per layer SLIDING | FULL; None: all FULL
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    extra: dict = field(default_factory=dict)  # the family's own settings (see its ``hf_config``)

    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window in tokens (a query sees itself and the W-1 before it), or
        None for full attention."""
        types = self.layer_types or [FULL] * self.num_layers
        return [self.sliding_window if t == SLIDING and self.sliding_window else None for t in types]

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "model") -> ModelConfig:
        """Build from a config.json dict (transformers 4.x and 5.x spellings both accepted)."""
        from ..errors import ModelLoadError
        from .models.registry import family_for, supported

        model_type = cfg.get("model_type", "?")
        family = family_for(model_type)
        if family is None:
            archs = cfg.get("architectures") or [model_type]
            raise ModelLoadError(
                f"unsupported architecture {archs[0]!r} (model_type {model_type!r}); "
                f"supported: {', '.join(supported())}"
            )
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if rope and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        out = cls(
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
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            name=name,
            hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            partial_rotary_factor=float(partial or 1.0),
        )
        family.hf_config(cfg, out)
        return out
