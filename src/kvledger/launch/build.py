"""The composition root: one function builds an engine's parts from its settings, each part given what
it needs through its constructor, in the order they depend on each other:

    settings checked -> TP group -> model (with its communicator; + LoRA) -> pool sizes -> tiers ->
    pools and ledger -> KV buffer, compile, runner (with its CUDA graphs; + HiSparse) -> connectors
    (tiers, PD) -> executor (+ TP: the pool's shape to the workers) -> drafter, grammars, scheduler,
    sessions -> ``EngineParts``

No part has an attribute set after its construction: the model is built with the communicator its
forward uses (TP's shared-memory one is made once the model is read: its slot is sized by the
model's shapes, not the pool's), and the runner with the capture of its CUDA graphs (called by its
constructor, once the model's attention knows the KV dtype the capture writes).

``EngineCore`` (``engine/core.py``) takes the parts and runs the step; ``start_engine`` does both,
then warms a compiled model up. The worker ranks' side of the same build is ``parallel/ranks.py``."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Comm, rank_threads
from ..common import Limits, SamplingParams
from ..config import EngineConfig
from ..connector import KVConnector, MultiConnector
from ..constrained import GrammarBackend
from ..disagg import make_connector
from ..engine.core import EngineCore
from ..engine.executor import Executor, InProcessExecutor
from ..engine.graph_capture import GraphCapture
from ..engine.graph_runner import DecodeGraphRunner, graph_max_bs, make_graph_runner
from ..engine.introspect import EngineInfo
from ..engine.malloc import keep_heap_memory, trim_heap
from ..engine.page_table import PageTable
from ..engine.runner import ModelRunner
from ..kernels import set_threads
from ..memory import KVBuffer, KVManager, release_window
from ..memory.sparse_kv import SparseKV
from ..model import LlamaModel
from ..model.chat_templates import install_chat_template, template_stop_ids
from ..model.loader import LoadedModel
from ..model.lora import LoraSet
from ..multimodal.encoder import VisionEncoder
from ..parallel.ranks import (
    pd_with_tiers,
    sampling_backend,
    sharded_model,
)
from ..scheduler import Scheduler, SessionManager
from ..spec.setup import make_proposer
from ..testing import faults
from .model_build import build_model
from .parts import grammars_of, hisparse_of, limits_of, loras_of, overlap_schedule, tiers_of
from .plan import PoolPlan, engine_info, plan_pool
from .validate import check_settings

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
    device = check_settings(cfg)  # every settings check that needs no model; the device the engine runs on
    if ":" in device:  # cuda:N: this process's current device (allocations, streams)
        torch.cuda.set_device(torch.device(device))
    set_threads(rank_threads(cfg))  # torch's and the kernels' pools: this process's cores
    if device == "cpu":
        keep_heap_memory()
    t0 = time.monotonic()
    comm_for: Callable[[Any], Comm] = _one_rank
    workers: list = []
    if cfg.parallel.tp_size > 1:  # the other ranks start while this one loads
        from ..parallel.executor import share_comm, start_group

        _, workers = start_group(cfg)
        # Once the model is read, before its shards are built: the forward's communicator (shared
        # memory on one machine), which the model is constructed with.
        comm_for = functools.partial(share_comm, cfg, workers=workers)
    opened: dict[str, Any] = {}  # what a failed start closes
    try:
        parts = _build(cfg, loaded, connector, graph_capture, device, comm_for, workers, t0, opened)
    except BaseException:
        _close_partial_start(opened.get("connector") or opened.get("tiers"), workers)
        raise
    if device == "cpu":
        trim_heap()  # the load's freed buffers back to the OS, once (engine/malloc.py)
    return parts, workers


def _one_rank(mc) -> Comm:
    """One rank's communicator: no collectives."""
    return Comm()


def _build(
    cfg: EngineConfig, loaded: LoadedModel | None, connector: KVConnector | None, graph_capture: GraphCapture | None,
    device: str, comm_for: Callable[[Any], Comm], workers: list, t0: float, opened: dict[str, Any],
) -> EngineParts:  # fmt: skip
    """Every part, in the order of the module's docstring; what needs closing is put in ``opened``."""
    cfg, m = build_model(cfg, loaded, device, comm_for, t0)
    loaded, model, dtype = m.loaded, m.model, m.dtype
    mc = loaded.config
    loras = loras_of(cfg, model)
    plan = plan_pool(cfg, mc, model, device, graph_capture)
    ps, total, context, lc = cfg.cache.page_size, plan.total, plan.context, model.cfg
    run_cfg = cfg.replace(max_total_tokens=total, context_length=context)  # the settings as they run
    kv_buffer = KVBuffer(lc.num_layers, total, lc.num_kv_heads, lc.head_dim, plan.kv_dtype, device)
    table = PageTable(cfg.scheduler.max_running_requests, context, ps, device)
    tiers, hicache, tier_books = tiers_of(cfg, connector, loaded.path, lc, kv_buffer, plan.num_pages, device, opened)
    connector = connector if hicache is None else hicache
    num_host, sparse = hisparse_of(cfg, device, model, mc, plan.num_pages, dtype)
    # KV-pool pages a sparse request holds: --hisparse-hot-pages where selected pages are copied into hot
    # pages (the torch reference, a device); one (the write page) where the kernel reads the host in place.
    hot = 0 if sparse is None else (1 if model.attn.hisparse_in_place(sparse) else cfg.hisparse.hisparse_hot_pages)
    # ``scheduler`` is built below: the ledger's owner walk and PD's abort call it once requests run.
    kv_manager = KVManager(
        num_pages=plan.num_pages,
        page_size=ps,
        num_slots=cfg.scheduler.max_running_requests,
        enable_prefix_cache=cfg.cache.enable_prefix_cache,
        strict=cfg.cache.strict_memory,
        holdings=faults.ledger_holdings(lambda: scheduler.holdings()),
        tiers=tiers,
        window=release_window(mc.layer_windows()),  # every layer windowed: pages leave as requests run
        tier_books=tier_books,
        sparse=None if sparse is None else (lambda km: SparseKV(km, cfg.hisparse, num_host, context, hot)),
    )
    if cfg.kernels.enable_torch_compile:
        model.enable_compile()  # (before the graphs' capture: it may replace the embedding's table)
    graphs = _graphs(cfg, plan, model, kv_buffer, table, kv_manager, graph_capture)
    encoder = None
    if loaded.vision is not None:  # a vision-language model: its encoder runs beside the forward
        encoder = VisionEncoder(loaded.vision, dtype, torch.device(device), mc.hidden_size)
    runner = ModelRunner(
        model, kv_buffer, table, cfg.scheduler.seed, sampling_backend(cfg, device), sparse, graphs, encoder
    )
    limits = limits_of(cfg, mc, context)
    # The PD transport (None without PD); it reaches the scheduler only through its thread-safe abort.
    disagg = None
    if cfg.disagg.enabled and (connector is None or hicache is not None):
        disagg = make_connector(cfg, kv_buffer, lambda *a: scheduler.abort(*a), limits, mc.num_kv_heads, sparse)
        connector = disagg if hicache is None else MultiConnector(pd_with_tiers(cfg, hicache, disagg), ps)
    opened["connector"] = connector
    executor = _executor(run_cfg, runner, connector, plan, workers)
    tokenizer = loaded.tokenizer
    eos = _eos(cfg, loaded)
    proposer = make_proposer(cfg, model, total)
    grammars = grammars_of(cfg, tokenizer, mc.vocab_size, eos)
    overlap = overlap_schedule(run_cfg, connector)
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else (lambda ids: "")
    row_bytes = mc.hidden_size * dtype.itemsize if encoder is not None else 0  # an image embedding's row
    scheduler = Scheduler(
        run_cfg, kv_manager, context, eos, decode, connector, proposer, mc.vocab_size, overlap, row_bytes
    )
    sessions = SessionManager(kv_manager.sessions, cfg.scheduler.max_sessions, cfg.scheduler.session_timeout_s, ps)
    info = engine_info(cfg, mc, loaded, model, plan, workers, (t0, m.t_read, m.t_model))
    return EngineParts(
        run_cfg, model, tokenizer, loras, kv_manager, runner, connector, disagg, executor, grammars, scheduler,
        sessions, limits, overlap, info, m.weight_shapes,
        lambda new: sharded_model(run_cfg, new, model.net.comm, dtype, device),
    )  # fmt: skip


def _executor(
    run_cfg: EngineConfig, runner: ModelRunner, connector: KVConnector | None, plan: PoolPlan, workers: list
) -> Executor:
    """The executor the step calls: in-process (behind the fault injection of tests), or with TP
    rank 0's, which broadcasts each step to the workers."""
    executor: Executor = faults.wrap_executor(InProcessExecutor(runner, connector))
    if run_cfg.parallel.tp_size > 1:
        from ..parallel.executor import TPExecutor, share_pool

        share_pool(plan.total, plan.context)  # the workers build the same pool, then their runners
        executor = TPExecutor(executor, workers, runner)
    return executor


def _eos(cfg: EngineConfig, loaded: LoadedModel) -> set[int]:
    """The tokens that end generation: the model's EOS, the tokenizer's, and the end-of-turn tokens
    of the chat template the model is served with (the HTTP front resolves the same one), which is
    installed on the tokenizer here."""
    mc, tokenizer = loaded.config, loaded.tokenizer
    template = install_chat_template(tokenizer, cfg.model.chat_template, loaded.path)
    eos = set(mc.eos_token_ids) | ({tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set())
    eos |= template_stop_ids(template.text, tokenizer, cfg.model.chat_template)
    log.info("chat template: %s", template.source)
    return eos


def _graphs(
    cfg: EngineConfig, plan: PoolPlan, model: LlamaModel, kv_buffer: KVBuffer, table: PageTable, kv_manager: KVManager,
    graph_capture: GraphCapture | None,
) -> Callable[[], DecodeGraphRunner] | None:  # fmt: skip
    """How the runner captures the decode steps' CUDA graphs (None: no graphs): called by its
    constructor once the model's attention knows the KV dtype, before any request runs (the padding
    page is reserved from a full pool)."""
    if not plan.graphs:
        return None
    max_bs = graph_max_bs(cfg.kernels.cuda_graph_max_bs, cfg.scheduler.max_running_requests)
    return functools.partial(make_graph_runner, model, kv_buffer, table, kv_manager, max_bs, graph_capture)


def _warm_up_compile(core: EngineCore) -> None:
    """Compile the graph before serving: a batch of two short requests runs through the normal
    scheduler and release path (so the books stay exact), then the prefix cache is dropped."""
    t0 = time.monotonic()
    log.info("torch.compile: compiling the forward (tens of seconds) ...")
    vocab = core.model.cfg.vocab_size
    for j in range(2):
        ids = [(7 + 31 * j + i) % vocab for i in range(8)]
        core.submit(core.make_request(ids, SamplingParams(max_new_tokens=3, ignore_eos=True), rid=f"warm-up-{j}"))
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
