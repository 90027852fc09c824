"""The first step of the composition root: the model read (unless the caller did) and this rank's
shard of it built in the dtype the settings resolve to, checked against the settings; from here on
the settings name what runs."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Comm
from ..compat import check_model
from ..config import EngineConfig
from ..engine.resources import auto_stored, resolve_dtype
from ..engine.weights import checkpoint_shapes
from ..memory import release_window
from ..model import LlamaModel, load_model
from ..model.chat_templates import read_chat_template
from ..model.config import ModelConfig
from ..model.loader import LoadedModel, default_model_path, load_tokenizer, release_file_pages
from ..parallel.ranks import model_quantization, sharded_model
from ..parallel.shard import check_tp


@dataclass(frozen=True)
class BuiltModel:
    """The model as read and built for this rank, and how long each took."""

    loaded: LoadedModel
    model: LlamaModel
    dtype: torch.dtype
    weight_shapes: dict  # the checkpoint's, what a weight update must match
    t_read: float
    t_model: float


def build_model(
    cfg: EngineConfig, loaded: LoadedModel | None, device: str, comm_for: Callable[[ModelConfig], Comm], t0: float
) -> tuple[EngineConfig, BuiltModel]:
    """Read the model (unless the caller did) and build this rank's shard of it in the dtype the
    settings resolve to; checked against the settings (TP's divisibility, the compatibility table).
    ``comm_for``: the communicator the forward uses, made once the model's shapes are known (TP's
    shared-memory slot is sized by them) and given to the model's constructor. Returns the settings
    naming what runs (device, quantization, attention backend) and the model."""
    if cfg.model.chat_template:  # a bad template stops the start before the model is read
        read_chat_template(cfg.model.chat_template)
    tokenizer = None
    if loaded is None:
        path = cfg.model.model or default_model_path()
        tokenizer = _Background(functools.partial(load_tokenizer, path, read_file=False))
        loaded = load_model(cfg.model.model, load_tokenizer=False)
    t_read = time.monotonic() - t0
    mc = loaded.config
    weight_shapes = checkpoint_shapes(loaded)  # what a weight update must match
    check_tp(mc, cfg.parallel.tp_size)
    stored = auto_stored(cfg.model.quantization, loaded.stored_quantization)
    dtype = resolve_dtype(cfg.model.dtype, device, cfg.model.explicit_quantization, stored)
    model = sharded_model(cfg, loaded, comm_for(mc), dtype, device)
    release_file_pages(loaded)  # the repacked layers and the kernels' copies no longer read the file's pages
    if tokenizer is not None:  # (a GGUF's not yet in the cache: converted now, its index read above)
        loaded.tokenizer = tokenizer.result() or (None if os.path.isdir(path) else load_tokenizer(path))
    t_model = time.monotonic() - t0 - t_read
    # From here on the settings name what runs (the L3 cache keys, /get_server_info).
    cfg = cfg.replace(
        device=device, quantization=model_quantization(cfg, loaded, dtype, device), attention_backend=model.attention
    )
    # The model's own features against the settings' (the compatibility table).
    check_model(cfg, device, ["sliding_window"] if release_window(mc.layer_windows()) else [])
    check_model(cfg, device, ["routed_experts"] if mc.num_experts else [], detail=mc.arch)
    return cfg, BuiltModel(loaded, model, dtype, weight_shapes, t_read, t_model)


class _Background:
    """``fn(*args)`` on a daemon thread; ``result()`` waits for it and returns or raises what it did.
    The tokenizer loads beside the model's read and build (transformers' import and the tokenizer's
    load, ~1 s of a warm start, mostly overlap the weights' packing, which runs outside the GIL).
    Daemon: an engine whose model fails to load exits without waiting for it."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="load-tokenizer", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # handed to the caller of result()
            self._error = e

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
