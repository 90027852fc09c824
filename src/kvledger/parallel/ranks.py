"""What every rank builds the same way: its shards of the model, the KV pool's element type, the
sampler's side; and a worker rank's (1..N-1) own parts, its runner and its side of the KV connector
(``worker.py`` runs them). Rank 0 builds the rest in ``launch/build.py``."""

from __future__ import annotations

import torch

from ..comm import Comm
from ..config import EngineConfig
from ..connector import KVConnector, MultiConnector, NoOpConnector
from ..disagg import make_worker_side
from ..engine.page_table import PageTable
from ..engine.resources import auto_stored, resolve_dtype, resolve_quantization
from ..engine.runner import ModelRunner
from ..hicache import build_worker_side
from ..memory import KVBuffer
from ..model import LlamaModel, load_model
from ..model.loader import LoadedModel, default_model_path
from .shard import local_config, shard_weights


def model_quantization(cfg: EngineConfig, loaded: LoadedModel, dtype, device: str) -> str | None:
    """The weight-only quantization this model runs with (``auto`` resolved against the file); every
    rank resolves it from the same settings and file."""
    return resolve_quantization(cfg.model.quantization, dtype, device, loaded.stored_quantization)


def sharded_model(cfg: EngineConfig, loaded: LoadedModel, comm: Comm, dtype, device: str) -> LlamaModel:
    """This rank's model: the checkpoint's shards for ``comm.rank`` (all of it on one rank)."""
    mc = loaded.config
    weights = shard_weights(mc, dict(loaded.weights), comm.rank, comm.size)
    return LlamaModel(
        local_config(mc, comm.rank, comm.size),
        weights,
        dtype=dtype,
        device=device,
        attention=cfg.kernels.attention_backend,
        quantization=model_quantization(cfg, loaded, dtype, device),
        int8_batch=cfg.kernels.enable_int8_batch,
        cpu_amx=cfg.kernels.cpu_amx,
        comm=comm,
        deterministic=cfg.kernels.enable_deterministic_inference,
    )


def kv_cache_dtype(cfg: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: the model's ``dtype`` (auto), or float8 e4m3 (``--kv-cache-dtype``)."""
    return torch.float8_e4m3fn if cfg.cache.kv_cache_dtype == "fp8_e4m3" else dtype


def sampling_backend(cfg: EngineConfig, device: str) -> str:
    """``host`` or ``device`` for ``--sampling-backend``; auto: device on CUDA (no copy of the logits
    each step), host on a CPU (measured no faster batched there: the same cores do both)."""
    if cfg.kernels.sampling_backend != "auto":
        return cfg.kernels.sampling_backend
    return "device" if torch.device(device).type == "cuda" else "host"


def tp_gather(cfg: EngineConfig):
    """The gather (to rank 0) the hierarchical cache's ranks report their file ops with (None on
    one rank)."""
    if cfg.parallel.tp_size == 1:
        return None
    from .frames import gather_tier_reports

    return gather_tier_reports


def pd_with_tiers(cfg: EngineConfig, tiers: KVConnector, transfer: KVConnector) -> list[KVConnector]:
    """PD with the hierarchical cache: the order a ``MultiConnector`` asks them in, the tiers first on
    both sides. Prefill loads a prefix from L2/L3 before it computes the rest (the transfer comes
    after the request finished); decode loads what its tiers hold past its L1 prefix, and the
    transfer brings the rest of the prompt."""
    return [tiers, transfer]


def build_runner(cfg: EngineConfig, comm: Comm, num_tokens: int, context: int, device: str = "cpu") -> ModelRunner:
    """A worker rank's runner: its shards of the model over the pool rank 0 decided on. With
    ``--enable-torch-compile`` it compiles its own graph, on the first forward of rank 0's warm-up
    (which reaches it as ordinary steps)."""
    loaded = load_model(cfg.model.model, load_tokenizer=False)
    stored = auto_stored(cfg.model.quantization, loaded.stored_quantization)
    dtype = resolve_dtype(cfg.model.dtype, device, cfg.model.explicit_quantization, stored)
    model = sharded_model(cfg, loaded, comm, dtype, device)
    if cfg.kernels.enable_torch_compile:
        model.enable_compile()
    lc = model.cfg
    kv_buffer = KVBuffer(lc.num_layers, num_tokens, lc.num_kv_heads, lc.head_dim, kv_cache_dtype(cfg, model.dtype), device)
    table = PageTable(cfg.scheduler.max_running_requests, context, cfg.cache.page_size, device)
    return ModelRunner(model, kv_buffer, table, cfg.scheduler.seed, sampling_backend(cfg, device))


def build_worker_connector(cfg: EngineConfig, rank: int, runner: ModelRunner) -> KVConnector | None:
    """A worker rank's side of the KV connector: the hierarchical cache's data movement for its heads
    (its L3 keys are its own, ``tp{rank}/{size}`` in their namespace), PD's (its heads into and out of
    a transfer, ``disagg/tp.py``), or both as rank 0's ``MultiConnector`` has them (one meta each);
    None without either."""
    pd = make_worker_side(cfg, rank)
    if not cfg.hicache.enable_hierarchical_cache:
        return pd
    model = runner.model
    path = cfg.model.model or default_model_path()  # what ``build_runner`` loaded
    worker = build_worker_side(
        cfg, path, model.quantization, model.cfg, runner.kv_buffer.k.dtype, runner.kv_buffer, rank, tp_gather(cfg)
    )
    if not cfg.disagg.enabled:
        return worker
    return MultiConnector(pd_with_tiers(cfg, worker, pd or NoOpConnector()), cfg.cache.page_size)
