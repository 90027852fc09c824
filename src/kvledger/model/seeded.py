"""Seeded draws that any device computes alike: a counter-based hash of ``(seed, position)`` to a
uniform, then the inverse CDF over a row's (filtered) probabilities.

Integer work only until the uniform, in int64 lanes that never overflow (32-bit words, 16-bit
multiplier halves), so the uniform is the same on a CPU and a GPU, in any batch; no generator state.
The host sampler and the device sampler both draw seeded rows through here."""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for ``h`` in [0, 2**32) without passing 2**63 (signed overflow)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer (a bijection of [0, 2**32) that spreads every input bit)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in [0, 1) (53 random bits) per row, from int64 ``seeds`` (in [0, 2**63))
    and ``positions``, on their device."""
    s_lo, s_hi = seeds & _M32, (seeds >> 32) & _M32
    h = _mix32(((positions & _M32) + 0x9E3779B9) & _M32)
    h = _mix32(h ^ s_lo)
    a = _mix32(h ^ s_hi)  # 32 bits
    b = _mix32(a ^ 0x7F4A7C15) >> 11  # 21 more
    return (a * 2**21 + b).double() * 2.0**-53


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs`` (``[n, V]``, unnormalised, zeros allowed) at cumulative
    mass ``u * total`` in vocabulary order: the first token whose cumulative mass (float64) passes it,
    which always has a nonzero probability. No sort: the mass before a token is a sum of the same
    float32 values on every device, in float64, so devices agree but for a 1e-16-wide chance."""
    cum = probs.double().cumsum(-1)
    idx = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(1), right=True)
    # u * total can round up to total: then the last token with any mass.
    nz = torch.arange(probs.shape[1], device=probs.device).expand_as(probs).masked_fill(probs <= 0, -1)
    last = nz.amax(-1, keepdim=True).clamp_min(0)
    return torch.minimum(idx, last).squeeze(1)
