"""Hot weight reload (``/update_weights_from_disk``, what RL trainers call between rollouts): the
checks that a new checkpoint can replace the running one, and loading it.

The new checkpoint must be the same model with other values: the same ``ModelConfig`` (its name
aside) and the same tensors with the same shapes. The engine builds a complete new model from it
(packing, quantization and prepacking as at start) before it lets the old one go, so any failure
leaves the old weights serving; the cost is both models in memory for the moment of the swap.

Not yet: tensor parallelism (every rank would have to load its shard in step), ``torch.compile``
(the graph froze the old weights; compiling again needs a warm-up), the hierarchical cache (its L2
pages and L3 files are keyed by the model loaded at start).
"""

from __future__ import annotations

import os
from dataclasses import asdict

from ..compat import check_request
from ..config import EngineConfig
from ..errors import KVLedgerError, ValidationError
from ..model import load_model
from ..model.config import ModelConfig
from ..model.loader import LoadedModel

# SGLang's load_format values that name what kvledger reads; None and "auto" take the path as it is.
LOAD_FORMATS = ("auto", "safetensors", "gguf")


def checkpoint_shapes(loaded: LoadedModel) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint with its shape: what a replacement must match."""
    return {name: tuple(w.shape) for name, w in loaded.weights.items()}


def check_reload_supported(cfg: EngineConfig) -> None:
    """The configurations a weight update cannot serve yet (400, before anything is read): the
    compatibility table's rows for weight updates."""
    check_request(cfg, "weight_update")


def load_replacement(
    path: object, load_format: object, running: ModelConfig, shapes: dict[str, tuple[int, ...]]
) -> LoadedModel:
    """Read the checkpoint at ``path`` and check that it can replace the running model; every
    refusal is a 400 naming what differs."""
    if not isinstance(path, str) or not path:
        raise ValidationError("model_path must be a non-empty string", param="model_path")
    if load_format is not None and load_format not in LOAD_FORMATS:
        raise ValidationError(
            f"load_format {load_format!r} is not supported; use one of {', '.join(LOAD_FORMATS)}",
            param="load_format",
        )
    if load_format == "gguf" and not os.path.isfile(path):
        raise ValidationError(f"load_format gguf needs a GGUF file; {path} is not a file", param="model_path")
    if load_format == "safetensors" and not os.path.isdir(path):
        raise ValidationError(
            f"load_format safetensors needs a model directory; {path} is not a directory", param="model_path"
        )
    try:
        loaded = load_model(path, load_tokenizer=False)
    except KVLedgerError as e:  # a missing, corrupt or unsupported checkpoint: the caller's path
        raise ValidationError(f"cannot load {path}: {e.message}", param="model_path") from None
    old, new = asdict(running), asdict(loaded.config)
    diffs = [f"{k} {old[k]!r} -> {new[k]!r}" for k in old if k != "name" and old[k] != new[k]]
    if diffs:
        raise ValidationError(
            f"{path} is not the running model's architecture ({'; '.join(diffs[:5])}); "
            f"updating weights needs the same shapes: restart the server to change the model",
            param="model_path",
            code="shape_mismatch",
        )
    got = checkpoint_shapes(loaded)
    for name, shape in shapes.items():
        if name not in got:
            raise ValidationError(f"{path} lacks tensor {name}", param="model_path", code="shape_mismatch")
        if got[name] != shape:
            raise ValidationError(
                f"{path}: tensor {name} has shape {list(got[name])}, the running model's {list(shape)}",
                param="model_path",
                code="shape_mismatch",
            )
    extra = sorted(set(got) - set(shapes))
    if extra:
        raise ValidationError(
            f"{path} has tensors the running model does not ({', '.join(extra[:3])})",
            param="model_path",
            code="shape_mismatch",
        )
    return loaded
