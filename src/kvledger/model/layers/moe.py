"""Top-k routed experts (Mixtral, Qwen3-MoE, GPT-OSS): a softmax router picks ``top_k`` experts per
token and the outputs are summed with the router's weights. Mixtral and Qwen3-MoE take the softmax
over every expert, then the top k (renormalized or not); GPT-OSS (``topk_softmax``) takes the top k
of the router's logits (a router with a bias), then the softmax over those k, and its experts have
biases and a clamped SwiGLU (``ClampedSwiGLU``).

The CPU path batches by expert: the (token, expert) pairs are sorted by expert once, and each expert
that got any tokens runs two matmuls over all of its tokens (one GEMM per expert, not one GEMV per
token and expert). Under tensor parallelism every rank holds a slice of every expert's hidden width
(the caller all-reduces), and the router is replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import activation


class ClampedSwiGLU:
    """GPT-OSS's expert activation: the gate clamped from above and the up projection on both sides
    at ``limit``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class MoE(nn.Module):
    """``gate_up`` ``[E, 2*I, H]`` (gate rows, then up rows), ``down`` ``[E, H, I]``, ``router`` ``[E, H]``;
    the optional biases ``router_bias`` ``[E]``, ``gate_up_bias`` ``[E, 2*I]``, ``down_bias`` ``[E, H]``.
    ``glu``: ``(gate, up) -> hidden`` in place of ``act(gate) * up``; ``topk_softmax``: the routing
    of ``route``."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        norm_topk_prob: bool = True,
        act: str = "silu",
        *,
        router_bias: torch.Tensor | None = None,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        topk_softmax: bool = False,
    ):
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.router_bias, self.gate_up_bias, self.down_bias = map(_param, (router_bias, gate_up_bias, down_bias))
        self.num_experts = router.shape[0]
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.topk_softmax = topk_softmax
        self.act = activation(act)
        self.glu = glu
        # --enable-deterministic-inference (``CausalLM``): each token alone, so that its router and expert
        # GEMMs have one shape (one order of sums) whatever the batch; batched by expert otherwise.
        self.row_wise = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, experts [T, k])``: softmax in fp32, top-k, renormalized
        (``norm_topk_prob``); with ``topk_softmax``, the top k of the logits, then their softmax."""
        logits = F.linear(x, self.router, self.router_bias).float()
        if self.topk_softmax:
            top, idx = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), idx
        probs = torch.softmax(logits, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_wise and x.shape[0] > 1:
            return torch.cat([self._experts(x[i : i + 1]) for i in range(x.shape[0])])
        return self._experts(x)

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        w = weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            sel = slice(start, start + n)
            start += n
            t = tokens[sel]
            gu_b = None if self.gate_up_bias is None else self.gate_up_bias[e]
            g, u = F.linear(x[t], self.gate_up[e], gu_b).chunk(2, dim=-1)
            d_b = None if self.down_bias is None else self.down_bias[e]
            h = self.act(g) * u if self.glu is None else self.glu(g, u)
            y = F.linear(h, self.down[e], d_b) * w[sel]
            out.index_add_(0, t, y)
        return out
