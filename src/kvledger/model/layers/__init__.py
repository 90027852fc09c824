"""The layers every model family is built of (mini-sglang's ``layers/``): attention over the paged
KV pool, gated MLPs, routed experts, RMS norms, rotary embeddings, the vocabulary ends. The linear
layer they all use is ``model/linear.py``'s ``Linear`` (dense, int8/int4, GGUF blocks)."""

from .attention import Attention
from .embedding import LMHead, VocabEmbedding
from .mlp import ACTIVATIONS, GatedMLP
from .moe import ClampedSwiGLU, MoE
from .norm import RMSNorm, gemma_rms_norm, rms_norm
from .rotary import Rotary, rope_inv_freq

__all__ = [
    "ACTIVATIONS",
    "Attention",
    "ClampedSwiGLU",
    "GatedMLP",
    "LMHead",
    "MoE",
    "RMSNorm",
    "Rotary",
    "VocabEmbedding",
    "gemma_rms_norm",
    "rms_norm",
    "rope_inv_freq",
]
