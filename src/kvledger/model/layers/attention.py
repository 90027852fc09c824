"""Self-attention of one layer: the fused QKV projection, optional q/k norms, rotary, the paged
attention of the model's backend (``model/attention.py``: ``torch`` or ``cpu``; windows, soft-capping,
sinks and the scale are the backend's per-layer settings), and the output projection. Under TP the heads
are this rank's; the caller all-reduces the output."""

from __future__ import annotations

import torch
from torch import nn

from ..attention_context import paged_attention
from ..linear import Linear
from .norm import RMSNorm
from .rotary import Rotary


class Attention(nn.Module):
    """``qk_norm``: ``per_head`` (Qwen3, Gemma 3: one norm over each head) or ``full`` (OLMo 2: over
    the whole projection, before the split into heads). ``sinks``: this layer's attention sinks
    (``[heads]``, GPT-OSS), held here and read by the backend (``CausalNet.attention_sinks``)."""

    def __init__(
        self,
        layer_id: int,
        qkv: Linear,
        o: Linear,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: Rotary,
        handle: int,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        qk_norm: str = "per_head",
        sinks: torch.Tensor | None = None,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.qkv, self.o = qkv, o
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.rotary = rotary
        self.handle = handle
        self.q_norm, self.k_norm = q_norm, k_norm
        self.qk_norm = qk_norm
        self.sinks = None if sinks is None else nn.Parameter(sinks, requires_grad=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cs, kops=None) -> torch.Tensor:
        """``cs``: this layer's rotary rows (``Rotary.lookup``, once per forward), unused with
        ``kops`` (kvledger's C++ kernels: rotary in place on the fused QKV rows)."""
        T = x.shape[0]
        qkv = self.qkv(x)
        qs, ks = self.q_size, self.kv_size
        if self.q_norm is not None and self.qk_norm == "full":
            q, k = self.q_norm(qkv[:, :qs]), self.k_norm(qkv[:, qs : qs + ks])
            q, k = q.view(T, self.heads, self.head_dim), k.view(T, self.kv_heads, self.head_dim)
        else:
            q = qkv[:, :qs].view(T, self.heads, self.head_dim)
            k = qkv[:, qs : qs + ks].view(T, self.kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
        v = qkv[:, qs + ks :].view(T, self.kv_heads, self.head_dim)
        rot = self.rotary
        if kops is not None:  # rotated in place; q and k heads are adjacent in the fused QKV row
            if self.q_norm is None:
                kops.rope_(
                    qkv[:, : qs + ks].view(T, self.heads + self.kv_heads, self.head_dim),
                    positions,
                    rot.cos,
                    rot.sin,
                )
            else:
                kops.rope_(q, positions, rot.cos, rot.sin)
                kops.rope_(k, positions, rot.cos, rot.sin)
        else:
            q, k = rot.apply(q, cs), rot.apply(k, cs)
        return self.o(paged_attention(q, k, v, self.layer_id, self.handle))
