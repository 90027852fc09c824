"""The architecture table: HF ``model_type`` -> the family class that serves it, and llama.cpp's
GGUF ``general.architecture`` -> ``model_type``. Adding a family is its file, its line here, and its
parity test (tests/unit/test_families.py; GGUF: tests/unit/test_families_gguf.py)."""

from __future__ import annotations

import importlib

ARCHITECTURES: dict[str, str] = {
    # model_type: "module:Class" (imported on first use)
    "llama": "llama:LlamaNet",
    "mistral": "llama:LlamaNet",
    "qwen2": "llama:LlamaNet",
    "qwen3": "llama:LlamaNet",
    "qwen2_vl_text": "llama:LlamaNet",  # Qwen2-VL's language model (M-RoPE; its vision side: multimodal/)
    "qwen2_5_vl_text": "llama:LlamaNet",
    "gemma2": "gemma2:Gemma2Net",
    "gemma3_text": "gemma3:Gemma3Net",
    "phi3": "phi3:Phi3Net",
    "olmo2": "olmo2:Olmo2Net",
    "qwen3_moe": "qwen3_moe:Qwen3MoeNet",
    "mixtral": "mixtral:MixtralNet",
    "gpt_oss": "gpt_oss:GptOssNet",
}

GGUF_ARCHITECTURES: dict[str, str] = {
    # GGUF general.architecture: model_type (the GGUF loader reads these families)
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "qwen3moe": "qwen3_moe",
}

GGUF_MOE_ARCHITECTURES: dict[str, str] = {
    # GGUF general.architecture of a file with routed experts ({arch}.expert_count > 0): model_type
    "llama": "mixtral",
}


def gguf_model_type(arch: str, expert_count: int = 0) -> str | None:
    """The ``model_type`` serving a GGUF of ``arch`` (with ``expert_count`` experts), or None."""
    if expert_count and arch in GGUF_MOE_ARCHITECTURES:
        return GGUF_MOE_ARCHITECTURES[arch]
    return GGUF_ARCHITECTURES.get(arch)


def family_for(model_type: str) -> type | None:
    """The ``CausalNet`` subclass (``base.py``) serving ``model_type``, or None where none does."""
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        return None
    module, cls = spec.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def supported() -> list[str]:
    return sorted(ARCHITECTURES)
