"""The KV pool's element type: values into a float8 pool rounded and saturating (``to_cache``), read
back widened to the queries' type (``widen``); the C++ casts where the kernels load, torch's
elsewhere. Every attention backend reads and writes the pool through these."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # float8 e4m3's largest finite value: torch's cast makes NaN of what lies beyond


def _f8_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """The C++ float8 casts apply to/from ``dtype`` on ``device`` (torch's run ~2 ns an element, on
    one thread)."""
    from .. import kernels

    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and kernels.load()


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the pool's element type; into a float8 pool rounded to nearest even and saturating at
    +-448, as the C++ decode kernel writes new tokens (a NaN in the cache would poison every later
    query's softmax): the kernels' cast where they load, torch's cast of the clamped value elsewhere
    (the same bytes: a test holds them equal)."""
    if dtype == torch.float8_e4m3fn:
        if _f8_kernels(x.device, x.dtype):
            return torch.ops.kvledger_cpu.to_f8(x)
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V gathered from the pool, in the queries' ``dtype`` (a copy only where the pool is float8;
    exact either way)."""
    if x.dtype == dtype:
        return x
    if x.dtype == torch.float8_e4m3fn and _f8_kernels(x.device, dtype):
        return torch.ops.kvledger_cpu.from_f8(x, dtype)
    return x.to(dtype)
