"""The pool's shape, decided once the model is loaded from what is left of the memory (``plan_pool``:
pages, tokens, the context, CUDA graphs, the KV dtype), and what the engine says it is once built
(``engine_info``: ``/get_server_info``'s engine part, logged once)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..engine.graph_capture import GraphCapture
from ..engine.graph_runner import graphs_planned
from ..engine.introspect import EngineInfo
from ..engine.resources import default_kv_tokens
from ..memory import KVBuffer
from ..model import LlamaModel
from ..model.loader import LoadedModel
from ..parallel.ranks import kv_cache_dtype

log = logging.getLogger("kvledger.engine.core")


@dataclass(frozen=True)
class PoolPlan:
    """The pool's shape, decided once the model is loaded (what is left of the memory)."""

    num_pages: int
    total: int  # tokens: num_pages * page_size
    context: int
    graphs: bool  # decode steps in CUDA graphs (they keep one page for their padding rows)
    kv_dtype: torch.dtype
    per_token: int  # KV bytes per token on this rank


def plan_pool(cfg: EngineConfig, mc, model: LlamaModel, device: str, graph_capture: GraphCapture | None) -> PoolPlan:
    """The KV pool's pages and tokens (``--max-total-tokens``, else what the device's memory leaves),
    whether decode steps run in CUDA graphs, and the context that fits."""
    ps = cfg.cache.page_size
    lc = model.cfg  # this rank's shapes (all of them on one rank)
    kv_dtype = kv_cache_dtype(cfg, model.dtype)
    per_token = KVBuffer.bytes_per_token(mc.num_layers, lc.num_kv_heads, mc.head_dim, kv_dtype)
    num_pages = max(1, (cfg.cache.max_total_tokens or default_kv_tokens(per_token, device)) // ps)
    total = num_pages * ps
    # Decode steps in CUDA graphs keep one page for their padding rows, out of every request's reach.
    graphs = graphs_planned(cfg.kernels.disable_cuda_graph, device, graph_capture, model, num_pages)
    context = min(cfg.model.context_length or mc.max_position_embeddings, mc.max_position_embeddings, total - ps * graphs)
    return PoolPlan(num_pages, total, context, graphs, kv_dtype, per_token)


def engine_info(cfg: EngineConfig, mc, loaded: LoadedModel, model: LlamaModel, plan: PoolPlan, workers: list, times) -> EngineInfo:
    """What the engine says it is (``/get_server_info``), logged once: ready, in how long."""
    t0, t_read, t_model = times
    ps = cfg.cache.page_size
    dtype_name = str(model.dtype).replace("torch.", "") + (f"+{cfg.model.quantization}" if cfg.model.quantization else "")
    info = EngineInfo(
        mc.name, loaded.path, dtype_name, plan.context, mc.vocab_size, ps, plan.total, plan.per_token,
        model.weight_bytes(), mc.arch, cfg.parallel.tp_size, [p.pid for p in workers], cfg.disagg.disaggregation_mode,
    )  # fmt: skip
    kv = "" if plan.kv_dtype == model.dtype else f", {str(plan.kv_dtype).removeprefix('torch.')}"
    log.info(
        "engine ready in %.1fs (model read %.1fs, built %.1fs) on %s: %s (%s, %s), weights %.0f MiB, "
        "KV %d tokens in pages of %d (%.0f MiB%s), context %d",
        time.monotonic() - t0, t_read, t_model, cfg.model.device, mc.name, mc.arch, dtype_name,
        info.weight_bytes / 2**20, plan.total, ps, plan.total * plan.per_token / 2**20, kv, plan.context,
    )  # fmt: skip
    return info
