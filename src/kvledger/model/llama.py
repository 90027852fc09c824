"""Llama-family forward (Llama, SmolLM, Mistral, Qwen2, Qwen3) over a paged KV pool.

Weights are plain tensors, fused where it saves Python ops per step (QKV, gate/up). Only the
positions named in ``batch.logit_index`` go through the final norm and the LM head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError
from .attention import AttentionBackend, KVBuffer, make_backend
from .batch import ForwardBatch
from .config import ModelConfig
from .linear import Linear


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the scaling types Llama-family checkpoints use."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    kind = (sc or {}).get("rope_type", (sc or {}).get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, scaled)
    raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers (variance in fp32, weight applied in the model dtype).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class _Layer:
    __slots__ = ("down", "gate_up", "in_norm", "k_norm", "o", "post_norm", "q_norm", "qkv")


class LlamaModel:
    """A causal LM over a paged KV pool. Holds no global state: several instances may coexist."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attention: str = "torch",
        quantization: str | None = None,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.attn: AttentionBackend = make_backend(attention, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

        def take(name: str) -> torch.Tensor:
            try:
                return weights.pop(name)
            except KeyError:
                raise ModelLoadError(f"checkpoint lacks tensor {name}") from None

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=dtype).contiguous()

        self.quantization = quantization

        def lin(w: torch.Tensor, b: torch.Tensor | None = None) -> Linear:
            return Linear(cast(w), None if b is None else cast(b), quantization)

        self.embed = cast(take("model.embed_tokens.weight"))
        lm_head = weights.pop("lm_head.weight", None)
        tied = lm_head is None or cfg.tie_word_embeddings
        self.lm_head = Linear(self.embed, None, quantization) if tied else lin(lm_head)
        self.norm = cast(take("model.norm.weight"))
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            qkv_b = None
            if cfg.attention_bias:
                qkv_b = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            layer.qkv = lin(torch.cat([q, k, v]), qkv_b)
            layer.o = lin(take(p + "self_attn.o_proj.weight"))
            layer.q_norm = cast(take(p + "self_attn.q_norm.weight")) if cfg.qk_norm else None
            layer.k_norm = cast(take(p + "self_attn.k_norm.weight")) if cfg.qk_norm else None
            gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
            layer.gate_up = lin(torch.cat([gate, up]))
            layer.down = lin(take(p + "mlp.down_proj.weight"))
            layer.in_norm = cast(take(p + "input_layernorm.weight"))
            layer.post_norm = cast(take(p + "post_attention_layernorm.weight"))
            self.layers.append(layer)
        inv = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        self.cos = freqs.cos().to(self.device, dtype)
        self.sin = freqs.sin().to(self.device, dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def weight_bytes(self) -> int:
        """Bytes of all weights held (int8 copies included; a tied LM head counted once)."""
        n = self.embed.numel() * self.embed.element_size() + self.norm.numel() * self.norm.element_size()
        lm = self.lm_head.nbytes - (
            self.embed.numel() * self.embed.element_size() if self.lm_head.w is self.embed else 0
        )
        n += lm
        for L in self.layers:
            n += sum(x.nbytes for x in (L.qkv, L.o, L.gate_up, L.down))
            n += sum(
                t.numel() * t.element_size()
                for t in (L.in_norm, L.post_norm, L.q_norm, L.k_norm)
                if t is not None
            )
        return n

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVBuffer) -> torch.Tensor:
        """Run one mixed batch; returns float32 logits ``[len(batch.logit_index), vocab]``."""
        cfg = self.cfg
        self.attn.prepare(batch)
        T = batch.num_tokens
        cos = self.cos[batch.positions].unsqueeze(1)
        sin = self.sin[batch.positions].unsqueeze(1)
        h = F.embedding(batch.input_ids, self.embed)
        eps = cfg.rms_norm_eps
        for i, L in enumerate(self.layers):
            x = _rms_norm(h, L.in_norm, eps)
            qkv = L.qkv(x)
            q = qkv[:, : self.q_size].view(T, cfg.num_heads, cfg.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(T, cfg.num_kv_heads, cfg.head_dim)
            if L.q_norm is not None:
                q = _rms_norm(q, L.q_norm, eps)
                k = _rms_norm(k, L.k_norm, eps)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            o = self.attn.forward(i, q, k, v, kv, batch)
            h = h + L.o(o)
            x = _rms_norm(h, L.post_norm, eps)
            gu = L.gate_up(x)
            g, u = gu.chunk(2, dim=-1)
            h = h + L.down(F.silu(g) * u)
        h = _rms_norm(h[batch.logit_index], self.norm, eps)
        return self.lm_head(h).float()
