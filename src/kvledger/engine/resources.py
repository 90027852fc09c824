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


def resolve_dtype(name: str, device: str, quantization: str | None = None, stored: str | None = None) -> torch.dtype:
    """``auto``: bfloat16 where the CPU has native bf16 (or on a GPU), float32 elsewhere; always
    bfloat16 with a weight-only quantization (its kernels take bf16 activations): one asked for by name
    (``quantization``), or a quantized checkpoint's own (``stored``, where the quantization setting is
    ``auto``) on a CPU whose int8 kernel runs it (AVX-512 VNNI)."""
    if name in ("float32", "fp32"):
        return torch.float32
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name != "auto":
        raise ValidationError(f"dtype must be auto, bfloat16 or float32, got {name!r}", param="dtype")
    # bf16 matmuls are ~2.5x faster than fp32 where the CPU has native bf16 (PERF-NOTES). Without it a
    # quantized file still runs best in its own blocks on the VNNI kernel (bf16 activations, widened
    # by shifts): a dequantized float32 copy is ~4-8x the bytes each decode step reads, and its
    # GEMMs (MKL's, per row count) and SDPA give a prompt's rows other bits as a prefix-cache hit's tail
    # than in one extend (issue 56; the kernels sum a row one way at any row count).
    if quantization or device != "cpu" or cpu_has_bf16():
        return torch.bfloat16
    return torch.bfloat16 if stored and _vnni_kernels() else torch.float32


def _vnni_kernels() -> bool:
    from .. import kernels

    return kernels.load() and kernels.quant_isa() == "avx512-vnni"


def auto_stored(quantization: str | None, stored: str | None) -> str | None:
    """The checkpoint's own quantization where the setting leaves it to the file (``auto``), for
    ``resolve_dtype``."""
    return stored if quantization == "auto" else None


def resolve_quantization(name: str | None, dtype: torch.dtype, device: str, stored: str | None) -> str | None:
    """``auto``: serve a quantized checkpoint in its own precision (``stored``: the loader's reading
    of the file) when the dtype is bfloat16; float32 is the unquantized reference path. The weight-only
    kernels are CPU kernels: on a GPU ``auto`` serves the dequantized weights in bf16 (the GEMMs are
    compute-, not bandwidth-bound there at these sizes)."""
    if name in (None, "none"):
        return None
    if name != "auto":
        return name
    if dtype != torch.bfloat16 or stored is None or device != "cpu":
        return None
    return stored


DEVICE_CHOICES = "auto | cpu | cuda | cuda:N"


def resolve_device(name: str) -> str:
    """The torch device a setting names: ``auto`` is the first CUDA device where torch sees one, else
    the CPU; ``cuda``/``cuda:N`` must exist. Checked before anything starts (a bad one is one line)."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    kind, _, index = name.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValidationError(f"device must be {DEVICE_CHOICES}, got {name!r}", param="device")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValidationError(
            f"device {name}: torch sees no CUDA device (torch {torch.__version__}, {build})", param="device"
        )
    if index and int(index) >= torch.cuda.device_count():
        raise ValidationError(
            f"device {name}: only {torch.cuda.device_count()} CUDA device(s)", param="device"
        )
    return name


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 1024**3


GPU_KV_FRACTION = 0.8  # of the device memory still free once the weights are loaded (SGLang's mem fraction)


def default_kv_tokens(bytes_per_token: int, device: str = "cpu") -> int:
    """The KV pool's default size: 2 GiB capped by a fifth of the RAM on a CPU; on a GPU most of the
    memory left after the weights (activations and the sampler need the rest)."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        budget = int(free * GPU_KV_FRACTION)
    else:
        budget = min(DEFAULT_KV_BYTES, _ram_bytes() // 5)
    return min(budget // bytes_per_token, DEFAULT_MAX_KV_TOKENS)
