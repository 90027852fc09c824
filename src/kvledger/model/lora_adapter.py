"""A LoRA adapter's files as peft saves them, read and checked (``read_adapter``): ``adapter_config.json``
(rank, alpha, target modules) and ``adapter_model.safetensors``
(``...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``),
into a ``LoraAdapter`` of float32 ``(A, B * scale)`` per (layer, module). Anything this server cannot
serve is a 400 (``bad_adapter``). Serving the adapters on the model's projections is ``lora.py``."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from ..errors import ValidationError

# The projections an adapter may target, by the fused layer that runs them (attribute of a layer).
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}  # fmt: skip
MODULES = tuple(m for ms in FUSED.values() for m in ms)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass
class LoraAdapter:
    """One adapter as loaded: its per-(layer, module) ``(A [r, in], B [out, r] * scale)`` float32."""

    name: str
    path: str
    rank: int
    alpha: float
    fingerprint: str  # sha256 of its files: the prefix cache's namespace for it
    target_modules: list[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False, default_factory=dict)

    def info(self) -> dict:
        return {"name": self.name, "path": self.path, "rank": self.rank, "alpha": self.alpha,
                "target_modules": self.target_modules}  # fmt: skip


def bad_adapter(message: str) -> ValidationError:
    return ValidationError(message, param="lora_path", code="invalid_lora_adapter")


def read_adapter(name: str, path: str, max_rank: int | None) -> LoraAdapter:
    """Read and check a peft LoRA adapter directory (400 for anything this server cannot serve)."""
    cfg_path, w_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise bad_adapter(f"LoRA adapter path {path!r} is not a directory")
    if not (os.path.isfile(cfg_path) and os.path.isfile(w_path)):
        raise bad_adapter(f"LoRA adapter path {path!r} lacks {CONFIG_FILE} or {WEIGHTS_FILE} (peft's save_pretrained)")
    try:
        with open(cfg_path, "rb") as f:
            raw_cfg = f.read()
        cfg = json.loads(raw_cfg)
        with open(w_path, "rb") as f:
            raw_w = f.read()
        tensors = load_safetensors(raw_w)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # unreadable, bad JSON or tensors
        raise bad_adapter(f"LoRA adapter at {path!r} cannot be read: {e}") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise bad_adapter(f"{cfg_path} is not a LoRA adapter config (peft_type {cfg.get('peft_type')!r})")
    unsupported = [
        k for k, bad in (
            ("use_dora", bool(cfg.get("use_dora"))), ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out"))),
            ("bias", cfg.get("bias", "none") != "none"), ("modules_to_save", bool(cfg.get("modules_to_save"))),
            ("rank_pattern", bool(cfg.get("rank_pattern"))), ("alpha_pattern", bool(cfg.get("alpha_pattern"))),
        ) if bad
    ]  # fmt: skip
    if unsupported:
        raise bad_adapter(f"LoRA adapter {name!r} uses {', '.join(unsupported)}, which this server does not serve")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise bad_adapter(f"{cfg_path} has no valid r / lora_alpha")
    if max_rank is not None and rank > max_rank:
        raise bad_adapter(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    scale = alpha / (rank**0.5 if cfg.get("use_rslora") else rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in MODULES:
            raise bad_adapter(f"LoRA adapter {name!r} has tensor {key}; only {', '.join(MODULES)} can be adapted")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    weights = {}
    for (layer, module), ab in pairs.items():
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise bad_adapter(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A/lora_B of rank {rank}")
        weights[(layer, module)] = (a.float().contiguous(), (b.float() * scale).contiguous())
    if not weights:
        raise bad_adapter(f"LoRA adapter {name!r} has no LoRA weights")
    digest = hashlib.sha256(raw_cfg + b"\0" + raw_w).hexdigest()
    targets = sorted({m for _, m in weights})
    return LoraAdapter(name, path, rank, float(alpha), digest, targets, weights)
