"""The parts that are there or not by their settings, each built from them alone: LoRA adapters,
HiSparse's worker, the hierarchical cache's tiers, the grammar backend, the limits validation holds
a request to, whether steps overlap. The composition root (``build.py``) puts them in place."""

from __future__ import annotations

import logging
import os

from ..common import Limits
from ..common.reasoning import REASONING_FORMATS
from ..compat import check_feature, check_model
from ..config import EngineConfig
from ..connector import KVConnector
from ..constrained import GrammarBackend
from ..constrained.reasoning import reasoning_end_ids
from ..errors import ValidationError
from ..hicache import HiCacheConnector, TierBooks, build_tiers
from ..memory import KVBuffer
from ..model import LlamaModel
from ..model.hisparse import SparseWorker
from ..model.lora import LoraSet
from ..model.lora_adapter import read_adapter
from ..parallel.ranks import tp_gather

log = logging.getLogger("kvledger.engine.core")


def limits_of(cfg: EngineConfig, mc, context: int) -> Limits:
    """The limits the one validation holds a request to (``common/validation.py``)."""
    return Limits(
        vocab_size=mc.vocab_size,
        context_length=context,
        max_stop_strings=cfg.scheduler.max_stop_strings,
        max_stop_string_len=cfg.scheduler.max_stop_string_len,
        max_top_logprobs=cfg.scheduler.max_top_logprobs,
        max_grammar_len=cfg.scheduler.max_grammar_len,
        max_grammar_depth=cfg.scheduler.max_grammar_depth,
        reasoning_parser=cfg.model.reasoning_parser,
    )


def overlap_schedule(cfg: EngineConfig, connector: KVConnector | None) -> bool:
    """Whether steps overlap (``scheduler/overlap.py``): ``--disable-overlap-schedule`` unset is on for
    CUDA and ``CPU_OVERLAP_DEFAULT`` on the CPU. Synchronous whatever the flag under tensor
    parallelism (the workers feed the tokens they are broadcast; rank 0 alone samples), with a KV
    connector (its worker side moves pages on its own threads, by the step's plan). HiSparse overlaps:
    a request's first sparse step gives its dense pages back after that step's own result
    (``SparseKV.drop_begun``), its rows feed placeholders like any decode's."""
    if cfg.parallel.tp_size > 1 or connector is not None:
        return False
    return cfg.scheduler.overlap_wanted(cfg.model.device)


def tiers_of(cfg: EngineConfig, connector, model_path: str, lc, kv_buffer: KVBuffer, num_pages: int, device: str, opened):
    """The hierarchical cache (``--enable-hierarchical-cache``): the L2/L3 tiers bound to the L1 pool,
    their connector and their books; ``(None, None, None)`` without it. ``opened``: where a failed
    start finds the tiers to close."""
    if not cfg.hicache.enable_hierarchical_cache:
        return None, None, None
    if connector is not None:
        check_feature(cfg, device, "connector")  # the hierarchical cache is a KV connector itself
    tiers = opened["tiers"] = build_tiers(cfg, model_path, lc, kv_buffer.k.dtype, num_pages, device)
    tiers.bind(kv_buffer)
    hicache = HiCacheConnector(tiers, tp_gather(cfg))
    return tiers, hicache, TierBooks(tiers, hicache)


def grammars_of(cfg: EngineConfig, tokenizer, vocab_size: int, eos: set[int]) -> GrammarBackend:
    """Structured outputs' backend; with ``--reasoning-parser``, grammars begin after the reasoning's
    end marker (its token ids)."""
    end_ids = None
    if (name := cfg.model.reasoning_parser) is not None:
        try:
            end_ids = reasoning_end_ids(tokenizer, REASONING_FORMATS[name].end)
        except ValueError as e:
            raise ValidationError(f"--reasoning-parser {name}: {e}", param="reasoning_parser") from None
    return GrammarBackend(tokenizer, vocab_size, sorted(eos), end_ids, cfg.scheduler.grammar_compile_timeout_s)


def check_lora_paths(cfg: EngineConfig) -> None:
    """Before anything starts: each ``--lora-paths`` adapter is a directory (what it holds is read,
    and checked, by ``loras_of``)."""
    for name, path in cfg.lora.named_paths().items():
        if not os.path.isdir(path):
            raise ValidationError(f"lora_paths: {name}={path} is not a directory", param="lora_paths")


def loras_of(cfg: EngineConfig, model: LlamaModel) -> LoraSet | None:
    """LoRA adapters (``model/lora.py``): None unless --enable-lora / --lora-paths."""
    if not cfg.lora.enable_lora:
        return None
    loras = LoraSet(cfg.lora.max_lora_rank)
    loras.attach(model)
    for name, path in cfg.lora.named_paths().items():
        loras.add(read_adapter(name, path, cfg.lora.max_lora_rank))
    return loras


def hisparse_of(cfg: EngineConfig, device: str, model: LlamaModel, mc, num_pages: int, dtype) -> tuple[int, SparseWorker | None]:
    """HiSparse (``--enable-hisparse``): its host pool's size in pages (the pools keep its books) and
    its worker (K/V with the runner; this process: no TP); ``(0, None)`` when it is off, or on a
    prefill server (its requests never decode)."""
    if not cfg.hisparse.enable_hisparse:
        return 0, None
    if cfg.disagg.disaggregation_mode == "prefill":
        log.info("HiSparse is decode-side: off on this prefill server (its requests never decode)")
        return 0, None
    lc = model.cfg  # this rank's shapes
    if model.attn.any_special:
        # attend_spans reads every request's pages through the slot table; a sparse slot's
        # history lives in the host pool, so the two cannot be combined (yet).
        check_model(cfg, device, ["special_attention"], detail=mc.arch)
    num_host = max(1, int(num_pages * cfg.hisparse.hisparse_host_ratio))
    ps = cfg.cache.page_size
    return num_host, SparseWorker(cfg.hisparse, num_host, mc.num_layers, lc.num_kv_heads, mc.head_dim, ps, dtype)
