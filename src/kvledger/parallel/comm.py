"""The collectives the forward calls. ``Comm`` (one rank) does nothing; ``TPComm`` wraps a
torch.distributed group (gloo on CPUs, NCCL on GPUs)."""

from __future__ import annotations

import torch


class Comm:
    """A single rank: identity collectives."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        return x


class TPComm(Comm):
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's logits for its slice of the vocabulary -> the whole vocabulary, on every rank."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
