"""Helpers the GPU checks share (``bench/gpu_check.py`` and its ``graphs`` step,
``bench/gpu_graphs.py``): the chat prompts, a model of SmolLM2's shape, random prompts."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

CHATS = [
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "Explain continuous batching in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What does a KV cache store?",
    "Give me a name for a cat.",
    "Why is the sky blue? Answer briefly, then explain the physics in more detail for a student.",
]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def build_full_model(args, layers: int | None = None) -> str:
    """SmolLM2-135M's shape and tokenizer with random bf16 weights (speed does not depend on the values);
    ``layers``: fewer layers (the ``--dry-run``'s)."""
    from transformers import AutoConfig, LlamaForCausalLM

    out = Path(args.work) / f"smollm2-shape{f'-{layers}l' if layers else ''}"
    if out.exists():
        shutil.rmtree(out)
    cfg = AutoConfig.from_pretrained(args.hf_config)
    if layers:
        cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in Path(args.hf_config).iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    return str(out)


def rand_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]
