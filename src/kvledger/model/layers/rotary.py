"""Rotary position embeddings (GPT-NeoX's rotate-half form), with the scaling types checkpoints use
and partial rotation (the first ``rot_dim`` dimensions of each head)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ...errors import ModelLoadError


def rope_inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies over ``dim`` rotated dimensions; scaling: default, linear, llama3."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = scaling
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


class Rotary(nn.Module):
    """cos/sin tables ``[max_positions, rot_dim / 2]`` in the model dtype."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None = None,
        partial: float = 1.0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rot_dim = int(head_dim * partial)
        inv = rope_inv_freq(self.rot_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", freqs.cos().to(device, dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device, dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``positions``, shaped to broadcast over heads: once per forward, all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x`` ``[T, heads, head_dim]`` rotated at the positions of ``cs`` (``lookup``)."""
        cos, sin = cs
        if self.rot_dim != self.head_dim:
            rot, rest = x[..., : self.rot_dim], x[..., self.rot_dim :]
            return torch.cat((_rotate(rot, cos, sin), rest), dim=-1)
        return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
