"""Choices made from the machine: the dtype ``auto`` means, and the KV pool's default size."""

from __future__ import annotations

import os

import torch

from ..errors import ValidationError

DEFAULT_KV_BYTES = 2 * 1024**3  # KV pool size when max_total_tokens is not given (capped by RAM)
DEFAULT_MAX_KV_TOKENS = 262144  # ... and by this many tokens (tiny models would otherwise get millions)


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str, quantization: str | None = None) -> torch.dtype:
    """``auto``: bfloat16 where the CPU has native bf16 (or on a GPU), float32 elsewhere; always
    bfloat16 with a weight-only quantization (its kernels take bf16 activations)."""
    if name in ("float32", "fp32"):
        return torch.float32
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name != "auto":
        raise ValidationError(f"dtype must be auto, bfloat16 or float32, got {name!r}", param="dtype")
    # bf16 matmuls are ~2.5x faster than fp32 where the CPU has native bf16 (PERF-NOTES).
    return torch.bfloat16 if quantization or device != "cpu" or cpu_has_bf16() else torch.float32


QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")


def explicit_quantization(name: str | None) -> str | None:
    """The quantization asked for by name (int8/int4), before ``auto`` is resolved against a model."""
    return name if name in ("int8", "int4") else None


def resolve_quantization(name: str | None, dtype: torch.dtype, device: str, stored: str | None) -> str | None:
    """``auto``: serve a quantized checkpoint in its own precision (``stored``: the loader's reading
    of the file) when the dtype is bfloat16; float32 is the unquantized reference path. int4 is
    CPU-only, so a Q4 file on a GPU gets int8."""
    if name in (None, "none"):
        return None
    if name != "auto":
        return name
    if dtype != torch.bfloat16 or stored is None:
        return None
    return "int8" if stored == "int4" and device != "cpu" else stored


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 1024**3


def default_kv_tokens(bytes_per_token: int) -> int:
    return min(min(DEFAULT_KV_BYTES, _ram_bytes() // 5) // bytes_per_token, DEFAULT_MAX_KV_TOKENS)
