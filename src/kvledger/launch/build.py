"""The composition root: one function builds an engine's parts from its settings, each part given what
it needs through its constructor, in the order they depend on each other:

    settings checked -> TP group -> model (+ LoRA) -> pool sizes -> tiers -> pools and ledger ->
    KV buffer and runner (+ HiSparse) -> connectors (tiers, PD) -> executor (+ TP) -> compile and
    graphs -> drafter, grammars, scheduler, sessions -> ``EngineParts``

``EngineCore`` (``engine/core.py``) takes the parts and runs the step; ``start_engine`` does both,
then warms a compiled model up. The worker ranks' side of the same build is ``parallel/ranks.py``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Comm, rank_threads
from ..common import Limits
from ..common.reasoning import REASONING_FORMATS
from ..compat import check_model
from ..config import EngineConfig
from ..connector import KVConnector, MultiConnector
from ..constrained import GrammarBackend
from ..constrained.reasoning import reasoning_end_ids
from ..disagg import make_connector
from ..engine.core import EngineCore
from ..engine.executor import Executor, InProcessExecutor
from ..engine.graph_runner import GraphCapture, graph_max_bs, graphs_planned, make_graph_runner
from ..engine.introspect import EngineInfo
from ..engine.malloc import keep_heap_memory
from ..engine.page_table import PageTable
from ..engine.resources import default_kv_tokens, resolve_dtype
from ..engine.runner import ModelRunner
from ..engine.weights import checkpoint_shapes
from ..errors import ValidationError
from ..hicache import HiCacheConnector, TierBooks, build_tiers
from ..memory import KVBuffer, KVManager, release_window
from ..memory.sparse_kv import SparseBooks, SparseKV
from ..model import LlamaModel, load_model
from ..model.hisparse import SparseWorker
from ..model.loader import LoadedModel
from ..model.lora import LoraSet, read_adapter
from ..parallel.ranks import (
    kv_cache_dtype,
    model_quantization,
    pd_with_tiers,
    sampling_backend,
    sharded_model,
    tp_gather,
)
from ..parallel.shard import check_tp
from ..scheduler import Scheduler, SessionManager
from ..spec.setup import make_proposer
from ..testing import faults

log = logging.getLogger("kvledger.engine.core")


@dataclass(frozen=True)
class EngineParts:
    """What ``EngineCore`` runs: every part built, wired, and the settings as they run (the device,
    the quantization, the pool's size and the context resolved)."""

    cfg: EngineConfig
    model: LlamaModel
    tokenizer: Any  # None for a model directory without tokenizer files (``input_ids`` only)
    loras: LoraSet | None  # --enable-lora
    kv_manager: KVManager  # the pools and their ledger (with the tiers' and HiSparse's books)
    runner: ModelRunner
    connector: KVConnector | None  # what the scheduler and the executor talk to: tiers, PD, both
    disagg_connector: KVConnector | None  # the PD transport alone (stats, a decode's peer check)
    executor: Executor  # in-process, or rank 0 of a TP group
    grammars: GrammarBackend
    scheduler: Scheduler
    sessions: SessionManager
    limits: Limits  # what validation holds a request to
    overlap: bool  # overlap scheduling on
    info: EngineInfo
    weight_shapes: dict  # the checkpoint's, what a weight update must match
    rebuild_model: Callable[[LoadedModel], LlamaModel]  # a weight update's model, on this rank's comm


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
    connector (its worker side moves pages on its own threads, by the step's plan) and with HiSparse
    (a request's first sparse step gives its dense pages back after that step's result)."""
    if cfg.parallel.tp_size > 1 or connector is not None or cfg.hisparse.enable_hisparse:
        return False
    return cfg.scheduler.overlap_wanted(cfg.model.device)


def start_engine(
    cfg: EngineConfig,
    loaded: LoadedModel | None = None,
    connector: KVConnector | None = None,
    graph_capture: GraphCapture | None = None,
) -> EngineCore:
    """An engine ready to serve: its parts built (``build_parts``), its core, and with
    ``--enable-torch-compile`` its graph compiled by a warm-up through the release path."""
    parts, workers = build_parts(cfg, loaded, connector, graph_capture)
    core = EngineCore(parts)
    if cfg.kernels.enable_torch_compile:
        try:
            _warm_up_compile(core)
        except BaseException:
            core.close_forward()
            _close_partial_start(parts.connector or parts.disagg_connector or parts.kv_manager.tiers, workers)
            raise
    return core


def build_parts(
    cfg: EngineConfig,
    loaded: LoadedModel | None = None,
    connector: KVConnector | None = None,
    graph_capture: GraphCapture | None = None,
) -> tuple[EngineParts, list]:
    """The parts, and this node's other TP ranks (their processes). ``connector``: a KV connector of
    the caller's (tests); ``graph_capture``: how decode steps are captured (``engine/graph_runner.py``;
    None: CUDA graphs on CUDA unless ``--disable-cuda-graph``, none elsewhere). Whatever raises, what
    was opened is closed: the connectors' ports and threads, the TP ranks and this process's group
    (a second engine in the same process could not form its group otherwise)."""
    device = cfg.check()  # every settings check that needs no model; the device the engine runs on
    if ":" in device:  # cuda:N: this process's current device (allocations, streams)
        torch.cuda.set_device(torch.device(device))
    if threads := rank_threads(cfg):
        torch.set_num_threads(threads)
    if device == "cpu":
        keep_heap_memory()
    t0 = time.monotonic()
    comm, workers = Comm(), []
    if cfg.parallel.tp_size > 1:  # the other ranks start loading while this one does
        from ..parallel.executor import start_group

        comm, workers = start_group(cfg)
    opened: dict[str, Any] = {}  # what a failed start closes
    try:
        return _build(cfg, loaded, connector, graph_capture, device, comm, workers, t0, opened), workers
    except BaseException:
        _close_partial_start(opened.get("connector") or opened.get("tiers"), workers)
        raise


def _build(
    cfg: EngineConfig,
    loaded: LoadedModel | None,
    connector: KVConnector | None,
    graph_capture: GraphCapture | None,
    device: str,
    comm: Comm,
    workers: list,
    t0: float,
    opened: dict[str, Any],
) -> EngineParts:
    loaded = loaded or load_model(cfg.model.model)
    t_read = time.monotonic() - t0
    mc = loaded.config
    weight_shapes = checkpoint_shapes(loaded)  # what a weight update must match
    check_tp(mc, cfg.parallel.tp_size)
    dtype = resolve_dtype(cfg.model.dtype, device, cfg.model.explicit_quantization)
    model = sharded_model(cfg, loaded, comm, dtype, device)
    t_model = time.monotonic() - t0 - t_read
    # From here on the settings name what runs (the L3 cache keys, /get_server_info).
    cfg = cfg.replace(
        device=device, quantization=model_quantization(cfg, loaded, dtype, device), attention_backend=model.attention
    )
    # The model's own features against the settings' (the compatibility table).
    check_model(cfg, device, ["sliding_window"] if release_window(mc.layer_windows()) else [])
    tokenizer = loaded.tokenizer
    loras = _loras(cfg, model)
    ps = cfg.cache.page_size
    lc = model.cfg  # this rank's shapes (all of them on one rank)
    kv_dtype = kv_cache_dtype(cfg, dtype)
    per_token = KVBuffer.bytes_per_token(mc.num_layers, lc.num_kv_heads, mc.head_dim, kv_dtype)
    num_pages = max(1, (cfg.cache.max_total_tokens or default_kv_tokens(per_token, device)) // ps)
    total = num_pages * ps
    # Decode steps in CUDA graphs keep one page for their padding rows, out of every request's reach.
    graphs = graphs_planned(cfg.kernels.disable_cuda_graph, device, graph_capture, model, num_pages)
    context = min(cfg.model.context_length or mc.max_position_embeddings, mc.max_position_embeddings, total - ps * graphs)
    run_cfg = cfg.replace(max_total_tokens=total, context_length=context)
    limits = limits_of(cfg, mc, context)
    tiers = opened["tiers"] = (
        build_tiers(cfg, loaded.path, lc, kv_dtype, num_pages, device) if cfg.hicache.enable_hierarchical_cache else None
    )
    # ``scheduler`` is built below: the ledger's owner walk and PD's abort call it once requests run.
    kv_manager = KVManager(
        num_pages=num_pages,
        page_size=ps,
        num_slots=cfg.scheduler.max_running_requests,
        enable_prefix_cache=cfg.cache.enable_prefix_cache,
        strict=cfg.cache.strict_memory,
        holdings=faults.ledger_holdings(lambda: scheduler.holdings()),
        tiers=tiers,
        window=release_window(mc.layer_windows()),  # every layer windowed: pages leave as requests run
    )
    kv_buffer = KVBuffer(lc.num_layers, total, lc.num_kv_heads, lc.head_dim, kv_cache_dtype(cfg, model.dtype), device)
    table = PageTable(cfg.scheduler.max_running_requests, context, ps, device)
    sparse = _hisparse(cfg, model, mc, kv_manager, num_pages, context, dtype)
    runner = ModelRunner(model, kv_buffer, table, cfg.scheduler.seed, sampling_backend(cfg, device), sparse)
    hicache = None
    if tiers is not None:
        if connector is not None:
            raise ValidationError("the hierarchical cache is a KV connector itself; pass one or the other")
        tiers.bind(kv_buffer)
        connector = hicache = HiCacheConnector(tiers, tp_gather(cfg))
        kv_manager.ledger.tiers = TierBooks(tiers, hicache)
    # The PD transport (None without PD); it reaches the scheduler only through its thread-safe abort.
    disagg = None
    if cfg.disagg.enabled and (connector is None or hicache is not None):
        disagg = make_connector(cfg, kv_buffer, lambda *a: scheduler.abort(*a), limits, mc.num_kv_heads, sparse)
        connector = disagg if hicache is None else MultiConnector(pd_with_tiers(cfg, hicache, disagg), ps)
    opened["connector"] = connector
    executor: Executor = faults.wrap_executor(InProcessExecutor(runner, connector))
    if cfg.parallel.tp_size > 1:
        from ..parallel.executor import TPExecutor, share_setup

        # The workers build the same pool; on one machine the collectives move to shared memory.
        model.net.comm = share_setup(run_cfg, mc, total, context, workers)
        executor = TPExecutor(executor, workers)
    if cfg.kernels.enable_torch_compile:
        model.enable_compile()  # (before the capture: it may replace the embedding's table)
    if graphs:  # captured before any request (the padding page is reserved from a full pool)
        max_bs = graph_max_bs(cfg.kernels.cuda_graph_max_bs, cfg.scheduler.max_running_requests)
        runner.graphs = make_graph_runner(model, kv_buffer, table, kv_manager, max_bs, graph_capture)
    eos = set(mc.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    grammars = GrammarBackend(
        tokenizer, mc.vocab_size, sorted(eos), _reasoning_end_ids(cfg, tokenizer), cfg.scheduler.grammar_compile_timeout_s
    )
    overlap = overlap_schedule(run_cfg, connector)
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else (lambda ids: "")
    proposer = make_proposer(cfg, model, total)
    scheduler = Scheduler(run_cfg, kv_manager, context, eos, decode, connector, proposer, mc.vocab_size, overlap)
    sessions = SessionManager(kv_manager.sessions, cfg.scheduler.max_sessions, cfg.scheduler.session_timeout_s, ps)
    dtype_name = str(dtype).replace("torch.", "") + (f"+{cfg.model.quantization}" if cfg.model.quantization else "")
    info = EngineInfo(
        mc.name, loaded.path, dtype_name, context, mc.vocab_size, ps, total, per_token, model.weight_bytes(),
        mc.arch, cfg.parallel.tp_size, [p.pid for p in workers], cfg.disagg.disaggregation_mode,
    )  # fmt: skip
    log.info(
        "engine ready in %.1fs (model read %.1fs, built %.1fs) on %s: %s (%s, %s), weights %.0f MiB, "
        "KV %d tokens in pages of %d (%.0f MiB%s), context %d",
        time.monotonic() - t0, t_read, t_model, device, mc.name, mc.arch, dtype_name,
        info.weight_bytes / 2**20, total, ps, total * per_token / 2**20,
        "" if kv_dtype == dtype else f", {str(kv_dtype).removeprefix('torch.')}", context,
    )  # fmt: skip
    return EngineParts(
        run_cfg, model, tokenizer, loras, kv_manager, runner, connector, disagg, executor, grammars, scheduler,
        sessions, limits, overlap, info, weight_shapes, lambda new: sharded_model(run_cfg, new, model.net.comm, dtype, device),
    )  # fmt: skip


def _loras(cfg: EngineConfig, model: LlamaModel) -> LoraSet | None:
    """LoRA adapters (``model/lora.py``): None unless --enable-lora / --lora-paths."""
    if not cfg.lora.enable_lora:
        return None
    loras = LoraSet(cfg.lora.max_lora_rank)
    loras.attach(model)
    for name, path in cfg.lora.named_paths().items():
        loras.add(read_adapter(name, path, cfg.lora.max_lora_rank))
    return loras


def _hisparse(cfg: EngineConfig, model: LlamaModel, mc, kv_manager: KVManager, num_pages: int, context: int, dtype):
    """HiSparse (``--enable-hisparse``): the host pool's books with the pools, its K/V with the runner
    (this process: no TP); None when it is off, or on a prefill server (its requests never decode)."""
    if not cfg.hisparse.enable_hisparse:
        return None
    if cfg.disagg.disaggregation_mode == "prefill":
        log.info("HiSparse is decode-side: off on this prefill server (its requests never decode)")
        return None
    lc = model.cfg  # this rank's shapes
    if model.attn.any_special:
        # attend_spans reads every request's pages through the slot table; a sparse slot's
        # history lives in the host pool, so the two cannot be combined (yet).
        raise ValidationError(
            f"--enable-hisparse does not run with {mc.arch}'s sliding-window, soft-capped or sink attention"
        )
    num_host = max(1, int(num_pages * cfg.hisparse.hisparse_host_ratio))
    sparse = kv_manager.sparse = SparseKV(kv_manager, cfg.hisparse, num_host, context)
    kv_manager.ledger.sparse = SparseBooks(sparse)
    return SparseWorker(cfg.hisparse, num_host, mc.num_layers, lc.num_kv_heads, mc.head_dim, cfg.cache.page_size, dtype)


def _reasoning_end_ids(cfg: EngineConfig, tokenizer) -> list[int] | None:
    """The token ids of the reasoning's end marker (``--reasoning-parser``), where grammars begin."""
    name = cfg.model.reasoning_parser
    if name is None:
        return None
    try:
        return reasoning_end_ids(tokenizer, REASONING_FORMATS[name].end)
    except ValueError as e:
        raise ValidationError(f"--reasoning-parser {name}: {e}", param="reasoning_parser") from None


def _warm_up_compile(core: EngineCore) -> None:
    """Compile the graph before serving: a batch of two short requests runs through the normal
    scheduler and release path (so the books stay exact), then the prefix cache is dropped."""
    t0 = time.monotonic()
    log.info("torch.compile: compiling the forward (tens of seconds) ...")
    vocab = core.model.cfg.vocab_size
    for j in range(2):
        ids = [(7 + 31 * j + i) % vocab for i in range(8)]
        core.submit(core.make_request(ids, {"max_new_tokens": 3, "ignore_eos": True}, rid=f"warm-up-{j}"))
    while not core.scheduler.idle:
        core.step()
    core.control.flush_cache()
    log.info("torch.compile: ready in %.1fs", time.monotonic() - t0)


def _close_partial_start(closing, workers: list) -> None:
    """A start that failed part-way (a bootstrap port in use, settings the model refuses, a failed
    compile) closes what it opened: the connectors (their ports and threads), the TP ranks and this
    process's group."""
    if closing is not None:
        try:
            closing.close()
        except Exception:  # the start's own error is the one to raise
            log.exception("engine: closing a connector after a failed start")
    for p in workers:
        p.kill()
    if workers:
        import torch.distributed as dist

        dist.destroy_process_group()
