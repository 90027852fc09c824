"""Gated MLPs: ``down(act(gate(x)) * up(x))`` with gate and up fused into one linear layer
(SwiGLU for Llama-style models, GeGLU with tanh-approximated GELU for Gemma)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ModelLoadError
from ..linear import Linear


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu": F.gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ModelLoadError(
            f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}"
        ) from None


class GatedMLP(nn.Module):
    """``gate_up`` holds the gate rows then the up rows; under TP both are this rank's columns and
    ``down`` its rows (the caller all-reduces)."""

    def __init__(self, gate_up: Linear, down: Linear, act: str = "silu"):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.act_name = act
        self.act = activation(act)
        if act in ("silu", "swish"):
            gate_up.split_gated()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up.silu_gated(x) if self.act_name in ("silu", "swish") else None
        if act is None:
            g, u = self.gate_up(x).chunk(2, dim=-1)
            act = self.act(g) * u
        return self.down(act)
