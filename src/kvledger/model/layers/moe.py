"""Top-k routed experts (Mixtral, Qwen3-MoE): a softmax router picks ``top_k`` experts per token and
the outputs are summed with the router's weights.

The CPU path batches by expert: the (token, expert) pairs are sorted by expert once, and each expert
that got any tokens runs two matmuls over all of its tokens (one GEMM per expert, not one GEMV per
token and expert). Under tensor parallelism every rank holds a slice of every expert's hidden width
(the caller all-reduces), and the router is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import activation


class MoE(nn.Module):
    """``gate_up`` ``[E, 2*I, H]`` (gate rows, then up rows), ``down`` ``[E, H, I]``, ``router`` ``[E, H]``."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        norm_topk_prob: bool = True,
        act: str = "silu",
    ):
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.num_experts = router.shape[0]
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act = activation(act)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, experts [T, k])``: softmax in fp32, top-k, renormalized."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
            g, u = F.linear(x[t], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self.act(g) * u, self.down[e]) * w[sel]
            out.index_add_(0, t, y)
        return out
