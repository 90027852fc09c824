"""Token bitmasks: bit ``t % 32`` of int32 word ``t // 32`` set means token ``t`` is allowed
(xgrammar's layout). Applied with plain torch on the logits' device, so the model runner does not
need xgrammar."""

from __future__ import annotations

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set the disallowed tokens of ``logits[rows]`` to -inf in place (``bitmask`` has one row per
    entry of ``rows``). The mask goes up to the logits' device as int32 words and is unpacked there."""
    dev = logits.device
    words = torch.from_numpy(bitmask).to(dev, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> _BITS.to(dev)) & 1).bool().flatten(1)[:, : logits.shape[1]]
    idx = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
