"""RMS norms in the two orders of operations checkpoints are trained with."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's: the variance in fp32, the weight applied in the model dtype (transformers' order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's: ``(x_normed * (1 + w)).to(dtype)`` all in fp32; ``w1`` is ``1 + w`` in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w1).to(x.dtype)


class RMSNorm(nn.Module):
    """``gemma``: the checkpoint's weight is an offset from 1, and the product is taken in fp32 (its
    ``1 + w`` is kept in float32, so bf16 models lose nothing to the offset)."""

    def __init__(
        self, weight: torch.Tensor, eps: float, gemma: bool = False, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.eps, self.gemma = eps, gemma
        w = (1.0 + weight.float()) if gemma else weight.to(dtype or weight.dtype)
        self.weight = nn.Parameter(w.contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            return gemma_rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
