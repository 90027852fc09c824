"""Linear-layer weights, optionally with a weight-only int8 copy for small batches.

On this class of CPU a one-row matmul is bound by how fast the weights stream from memory, and
torch's ``_weight_int8pack_mm`` (int8 weights, per-output-channel scales, bf16 activations) reads
half the bytes of bf16 and runs 2-4x faster for 1-4 rows. From ~8 rows up the bf16 GEMM wins
(bench/RESULTS.md), so the int8 mode keeps both copies and picks per call by the number of rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = (None, "int8")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns ``(q [N, K] int8, scale [N] float32)``."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``; with an int8 copy, calls of at most ``int8_max_rows`` rows use it."""

    def __init__(
        self,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
        quantization: str | None = None,
        int8_max_rows: int = 4,
    ):
        super().__init__()
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        self.w = nn.Parameter(w, requires_grad=False)
        self.b = None if b is None else nn.Parameter(b, requires_grad=False)
        self.register_buffer("q", None, persistent=False)
        self.register_buffer("q_scale", None, persistent=False)
        self.int8_max_rows = int8_max_rows
        if quantization == "int8":
            if w.dtype != torch.bfloat16:
                raise ValueError("int8 weights need bfloat16 activations (dtype bfloat16)")
            q, scale = quantize_int8(w)
            self.register_buffer("q", q.to(w.device), persistent=False)
            self.register_buffer("q_scale", scale.to(device=w.device, dtype=w.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inside torch.compile the int8 branch would add a size guard and a second graph to compile;
        # compiled forwards carry several rows anyway, where bf16 is the faster choice.
        if self.q is not None and x.shape[0] <= self.int8_max_rows and not torch.compiler.is_compiling():
            y = torch._weight_int8pack_mm(x, self.q, self.q_scale)
            return y if self.b is None else y + self.b
        return F.linear(x, self.w, self.b)
