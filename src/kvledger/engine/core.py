"""The engine core: model, pools, scheduler and executor. Runs in-process (offline ``Engine``) or in
the engine process of the server; it is driven by calling ``step``."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass

import torch

from ..comm import Comm, rank_threads
from ..common import FinishReason, Limits, RequestOutput, validate_request
from ..common.pooling import PoolingParams, validate_pooling
from ..common.reasoning import REASONING_FORMATS
from ..compat import check_model, check_request
from ..config import EngineConfig
from ..connector import KVConnector, MultiConnector, NoOpConnector
from ..constrained import GrammarBackend, grammar_spec
from ..constrained.reasoning import reasoning_end_ids
from ..disagg import make_connector, make_worker_side
from ..errors import ConflictError, KVLedgerError, ModelLoadError, NotFoundError, ValidationError
from ..hicache import HiCacheConnector, TierBooks, build_tiers, build_worker_side
from ..memory import KVBuffer, KVManager, release_window
from ..memory.sparse_kv import SparseBooks, SparseKV
from ..model import LlamaModel, load_model
from ..model.hisparse import SparseWorker
from ..model.loader import LoadedModel, default_model_path
from ..model.lora import LoraSet, read_adapter
from ..parallel.errors import TPGroupBroken
from ..parallel.shard import check_tp, local_config, shard_weights
from ..scheduler import PAUSE_MODES, ModelRunnerOutput, Req, Scheduler, SchedulerOutput, SessionManager
from ..spec.setup import make_proposer
from ..testing import faults
from .executor import Executor, InProcessExecutor
from .graph_runner import GraphCapture, graph_max_bs, graphs_planned, make_graph_runner
from .malloc import keep_heap_memory
from .overlap import ForwardThread
from .page_table import PageTable
from .resources import (
    default_kv_tokens,
    resolve_dtype,
    resolve_quantization,
)
from .runner import ModelRunner
from .weights import check_reload_supported, checkpoint_shapes, load_replacement

log = logging.getLogger(__name__)

# How long a shutdown steps to let running work end before it closes anyway.
SHUTDOWN_DRAIN_S = 60.0


@dataclass
class EngineInfo:
    model_name: str
    model_path: str
    dtype: str
    context_length: int
    vocab_size: int
    page_size: int
    max_total_tokens: int
    kv_bytes_per_token: int = 0
    weight_bytes: int = 0
    arch: str = ""  # llama | qwen2 | qwen3 | mistral
    tp_size: int = 1
    tp_worker_pids: list[int] = dataclasses.field(default_factory=list)  # this node's other ranks
    disaggregation_mode: str | None = None  # prefill | decode | None


def check_config(cfg: EngineConfig) -> str:
    """The settings checks that need no model (``EngineConfig.check``: each section's, then the
    compatibility table): the CLI runs them before starting anything, so a bad flag is one line of
    error, not a failed start-up. Returns the device the engine runs on."""
    return cfg.check()


def model_quantization(cfg: EngineConfig, loaded: LoadedModel, dtype, device: str) -> str | None:
    """The weight-only quantization this model runs with (``auto`` resolved against the file); every
    rank resolves it from the same settings and file."""
    return resolve_quantization(cfg.model.quantization, dtype, device, loaded.stored_quantization)


def _sharded_model(cfg: EngineConfig, loaded: LoadedModel, comm: Comm, dtype, device: str) -> LlamaModel:
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


def _runner(cfg: EngineConfig, model: LlamaModel, device: str) -> ModelRunner:
    """The model runner over a KV buffer of ``cfg.cache.max_total_tokens`` (this rank's KV heads)."""
    lc = model.cfg
    kv_buffer = KVBuffer(
        lc.num_layers, cfg.cache.max_total_tokens, lc.num_kv_heads, lc.head_dim, kv_cache_dtype(cfg, model.dtype),
        device,
    )
    table = PageTable(cfg.scheduler.max_running_requests, cfg.model.context_length, cfg.cache.page_size, device)
    return ModelRunner(model, kv_buffer, table, cfg.scheduler.seed, sampling_backend(cfg, device))


def sampling_backend(cfg: EngineConfig, device: str) -> str:
    """``host`` or ``device`` for ``--sampling-backend``; auto: device on CUDA (no copy of the logits
    each step), host on a CPU (measured no faster batched there: the same cores do both)."""
    if cfg.kernels.sampling_backend != "auto":
        return cfg.kernels.sampling_backend
    return "device" if torch.device(device).type == "cuda" else "host"


def build_runner(
    cfg: EngineConfig, comm: Comm, num_tokens: int, context: int, device: str = "cpu"
) -> ModelRunner:
    """A worker rank's runner: its shards of the model over the pool rank 0 decided on. With
    ``--enable-torch-compile`` it compiles its own graph, on the first forward of rank 0's warm-up
    (which reaches it as ordinary steps)."""
    dtype = resolve_dtype(cfg.model.dtype, device, cfg.model.explicit_quantization)
    model = _sharded_model(cfg, load_model(cfg.model.model, load_tokenizer=False), comm, dtype, device)
    if cfg.kernels.enable_torch_compile:
        model.enable_compile()
    return _runner(cfg.replace(max_total_tokens=num_tokens, context_length=context), model, device)


def _tp_gather(cfg: EngineConfig):
    """The gather (to rank 0) the hierarchical cache's ranks report their file ops with (None on
    one rank)."""
    if cfg.parallel.tp_size == 1:
        return None
    from ..parallel.frames import gather_tier_reports

    return gather_tier_reports


def overlap_schedule(cfg: EngineConfig, connector: KVConnector | None) -> bool:
    """Whether steps overlap (``scheduler/overlap.py``): ``--disable-overlap-schedule`` unset is on for
    CUDA and ``CPU_OVERLAP_DEFAULT`` on the CPU. Synchronous whatever the flag under tensor
    parallelism (the workers feed the tokens they are broadcast; rank 0 alone samples), with a KV
    connector (its worker side moves pages on its own threads, by the step's plan) and with HiSparse
    (a request's first sparse step gives its dense pages back after that step's result)."""
    if cfg.parallel.tp_size > 1 or connector is not None or cfg.hisparse.enable_hisparse:
        return False
    return cfg.scheduler.overlap_wanted(cfg.model.device)


def pd_with_tiers(cfg: EngineConfig, tiers: KVConnector, transfer: KVConnector) -> list[KVConnector]:
    """PD with the hierarchical cache: the order a ``MultiConnector`` asks them in, the tiers first on
    both sides. Prefill loads a prefix from L2/L3 before it computes the rest (the transfer comes
    after the request finished); decode loads what its tiers hold past its L1 prefix, and the
    transfer brings the rest of the prompt."""
    return [tiers, transfer]


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
        cfg, path, model.quantization, model.cfg, runner.kv_buffer.k.dtype, runner.kv_buffer, rank, _tp_gather(cfg)
    )
    if not cfg.disagg.enabled:
        return worker
    return MultiConnector(pd_with_tiers(cfg, worker, pd or NoOpConnector()), cfg.cache.page_size)


class EngineCore:
    """Owns one model and one set of pools. No global state: several may live in one process."""

    def __init__(
        self,
        cfg: EngineConfig,
        loaded: LoadedModel | None = None,
        connector: KVConnector | None = None,
        graph_capture: GraphCapture | None = None,
    ):
        """``graph_capture``: how decode steps are captured (``engine/graph_runner.py``); None: CUDA
        graphs on CUDA (unless ``--disable-cuda-graph``), none elsewhere. The tests pass its CPU
        stand-in, ``EagerCapture``."""
        device = check_config(cfg)
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
        try:
            self._build(cfg, loaded, connector, graph_capture, device, comm, workers, t0)
        except BaseException:
            self._close_partial_start(workers)
            raise

    def _build(
        self,
        cfg: EngineConfig,
        loaded: LoadedModel | None,
        connector: KVConnector | None,
        graph_capture: GraphCapture | None,
        device: str,
        comm: Comm,
        workers: list,
        t0: float,
    ) -> None:
        """Everything after the TP group formed: the model, the pools, the connectors, the scheduler.
        Whatever raises here, ``__init__`` closes what was opened (``_close_partial_start``)."""
        loaded = loaded or load_model(cfg.model.model)
        t_read = time.monotonic() - t0
        mc = loaded.config
        self.weight_shapes = checkpoint_shapes(loaded)  # what a weight update must match
        check_tp(mc, cfg.parallel.tp_size)
        self.dtype = resolve_dtype(cfg.model.dtype, device, cfg.model.explicit_quantization)
        self.model = _sharded_model(cfg, loaded, comm, self.dtype, device)
        t_model = time.monotonic() - t0 - t_read
        # From here on the settings name what runs (the L3 cache keys, /get_server_info).
        cfg = cfg.replace(
            device=device,
            quantization=model_quantization(cfg, loaded, self.dtype, device),
            attention_backend=self.model.attention,
        )
        # The model's own features against the settings' (the compatibility table).
        check_model(cfg, device, ["sliding_window"] if release_window(mc.layer_windows()) else [])
        self.tokenizer = loaded.tokenizer
        # LoRA adapters (``model/lora.py``): None unless --enable-lora / --lora-paths.
        self.loras: LoraSet | None = None
        if cfg.lora.enable_lora:
            self.loras = LoraSet(cfg.lora.max_lora_rank)
            self.loras.attach(self.model)
            for name, path in cfg.lora.named_paths().items():
                self.loras.add(read_adapter(name, path, cfg.lora.max_lora_rank))
        ps = cfg.cache.page_size
        lc = self.model.cfg  # this rank's shapes (all of them on one rank)
        kv_dtype = kv_cache_dtype(cfg, self.dtype)
        per_token = KVBuffer.bytes_per_token(mc.num_layers, lc.num_kv_heads, mc.head_dim, kv_dtype)
        num_pages = max(1, (cfg.cache.max_total_tokens or default_kv_tokens(per_token, device)) // ps)
        total = num_pages * ps
        # Decode steps in CUDA graphs keep one page for their padding rows, out of every request's reach.
        graphs = graphs_planned(cfg.kernels.disable_cuda_graph, device, graph_capture, self.model, num_pages)
        context = min(
            cfg.model.context_length or mc.max_position_embeddings, mc.max_position_embeddings, total - ps * graphs
        )
        self.cfg = cfg.replace(max_total_tokens=total, context_length=context)
        tiers = None
        if cfg.hicache.enable_hierarchical_cache:
            tiers = build_tiers(cfg, loaded.path, lc, kv_dtype, num_pages, device)
        # Every layer windowed: the pages that leave the window go back while requests run.
        window = release_window(mc.layer_windows())
        self.kv_manager = KVManager(
            num_pages=num_pages,
            page_size=ps,
            num_slots=cfg.scheduler.max_running_requests,
            enable_prefix_cache=cfg.cache.enable_prefix_cache,
            strict=cfg.cache.strict_memory,
            holdings=faults.ledger_holdings(lambda: self.scheduler.holdings()),
            tiers=tiers,
            window=window,
        )
        runner = self.runner = _runner(self.cfg, self.model, device)
        if cfg.hisparse.enable_hisparse and cfg.disagg.disaggregation_mode == "prefill":
            log.info("HiSparse is decode-side: off on this prefill server (its requests never decode)")
        elif cfg.hisparse.enable_hisparse:
            if self.model.attn.any_special:
                # attend_spans reads every request's pages through the slot table; a sparse slot's
                # history lives in the host pool, so the two cannot be combined (yet).
                raise ValidationError(
                    f"--enable-hisparse does not run with {mc.arch}'s sliding-window, soft-capped or sink attention"
                )
            # HiSparse: the host pool's books here, its K/V with the runner (this process: no TP).
            num_host = max(1, int(num_pages * cfg.hisparse.hisparse_host_ratio))
            sparse = self.kv_manager.sparse = SparseKV(self.kv_manager, cfg.hisparse, num_host, context)
            self.kv_manager.ledger.sparse = SparseBooks(sparse)
            runner.sparse = SparseWorker(
                cfg.hisparse, num_host, mc.num_layers, lc.num_kv_heads, mc.head_dim, ps, self.dtype
            )
        hicache = None
        if tiers is not None:
            if connector is not None:
                raise ValidationError(
                    "the hierarchical cache is a KV connector itself; pass one or the other"
                )
            tiers.bind(runner.kv_buffer)
            connector = hicache = HiCacheConnector(tiers, _tp_gather(cfg))
            self.kv_manager.ledger.tiers = TierBooks(tiers, hicache)
        # The PD transport (None without PD); it reaches the scheduler (built below) only through its
        # thread-safe abort.
        self.disagg_connector = (
            make_connector(
                cfg,
                runner.kv_buffer,
                lambda *a: self.scheduler.abort(*a),
                self._limits(cfg, mc, context),
                mc.num_kv_heads,
            )
            if cfg.disagg.enabled and (connector is None or hicache is not None)
            else None
        )
        if self.disagg_connector is not None:
            if runner.sparse is not None and hasattr(self.disagg_connector, "host_sink"):
                self.disagg_connector.host_sink = runner.sparse  # (decode side: KV lands in host pages)
            connector = (
                self.disagg_connector if hicache is None
                else MultiConnector(pd_with_tiers(cfg, hicache, self.disagg_connector), ps)
            )  # fmt: skip
        self.connector = connector
        self.last_step_ran = False
        self.executor: Executor = faults.wrap_executor(InProcessExecutor(runner, connector))
        if cfg.parallel.tp_size > 1:
            from ..parallel.executor import TPExecutor, share_setup

            # The workers build the same pool; on one machine the collectives move to shared memory.
            self.model.net.comm = share_setup(self.cfg, mc, total, context, workers)
            self.executor = TPExecutor(self.executor, workers)
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        proposer = make_proposer(cfg, self.model, total)
        self.grammars = GrammarBackend(
            self.tokenizer,
            mc.vocab_size,
            sorted(eos),
            self._reasoning_end_ids(),
            cfg.scheduler.grammar_compile_timeout_s,
        )
        self.scheduler = Scheduler(
            self.cfg, self.kv_manager, context, eos, self._decode_raw, connector, proposer, mc.vocab_size
        )
        # Overlap scheduling: the forward thread, and the launched step whose result is not applied.
        self.overlap = overlap_schedule(self.cfg, connector)
        self.scheduler.overlap = self.overlap
        self._forward = ForwardThread(self._execute, device) if self.overlap else None
        self._in_flight: tuple[SchedulerOutput, object] | None = None
        # Steps launched while the previous one ran, and steps whose result the engine waited for at
        # once because the next schedule needs it (drafts, grammars, prompt logprobs, pooling).
        self.overlap_stats = {"overlapped": 0, "synchronous": 0}
        self.sessions = SessionManager(self.kv_manager.sessions, cfg.scheduler.max_sessions, cfg.scheduler.session_timeout_s, ps)
        self.limits = self._limits(cfg, mc, context)
        if cfg.kernels.enable_torch_compile:
            self.model.enable_compile()  # (before the capture: it may replace the embedding's table)
        if graphs:  # captured before any request (the padding page is reserved from a full pool)
            max_bs = graph_max_bs(cfg.kernels.cuda_graph_max_bs, cfg.scheduler.max_running_requests)
            runner.graphs = make_graph_runner(
                self.model, runner.kv_buffer, runner.page_table, self.kv_manager, max_bs, graph_capture
            )
        if cfg.kernels.enable_torch_compile:
            self._warm_up_compile()
        dtype_name = str(self.dtype).replace("torch.", "") + (
            f"+{cfg.model.quantization}" if cfg.model.quantization else ""
        )
        self.info = EngineInfo(
            mc.name,
            loaded.path,
            dtype_name,
            context,
            mc.vocab_size,
            ps,
            total,
            per_token,
            self.model.weight_bytes(),
            mc.arch,
            cfg.parallel.tp_size,
            [p.pid for p in workers],
            cfg.disagg.disaggregation_mode,
        )
        log.info(
            "engine ready in %.1fs (model read %.1fs, built %.1fs) on %s: %s (%s, %s), weights %.0f MiB, "
            "KV %d tokens in pages of %d (%.0f MiB%s), context %d",
            time.monotonic() - t0, t_read, t_model, device, mc.name, mc.arch, dtype_name,
            self.info.weight_bytes / 2**20, total, ps, total * per_token / 2**20,
            "" if kv_dtype == self.dtype else f", {str(kv_dtype).removeprefix('torch.')}", context,
        )  # fmt: skip

    def _close_partial_start(self, workers: list) -> None:
        """A start that failed part-way (a bootstrap port in use, settings the model refuses, a
        failed compile) closes what it opened: the forward thread, the connectors (their ports and
        threads), the TP ranks and this process's group. Without this a second engine in the same
        process could not form its group ("initialize the default process group twice")."""
        state = vars(self)
        if (fwd := state.get("_forward")) is not None:
            fwd.shutdown()
        conn = state["connector"] if "connector" in state else state.get("disagg_connector")
        km = state.get("kv_manager")
        closing = conn if conn is not None else getattr(km, "tiers", None)
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

    def _warm_up_compile(self) -> None:
        """Compile the graph before serving: a batch of two short requests runs through the normal
        scheduler and release path (so the books stay exact), then the prefix cache is dropped."""
        t0 = time.monotonic()
        log.info("torch.compile: compiling the forward (tens of seconds) ...")
        vocab = self.model.cfg.vocab_size
        for j in range(2):
            ids = [(7 + 31 * j + i) % vocab for i in range(8)]
            self.submit(self.make_request(ids, {"max_new_tokens": 3, "ignore_eos": True}, rid=f"warm-up-{j}"))
        while not self.scheduler.idle:
            self.step()
        self.flush_cache()
        log.info("torch.compile: ready in %.1fs", time.monotonic() - t0)

    def _reasoning_end_ids(self) -> list[int] | None:
        """The token ids of the reasoning's end marker (``--reasoning-parser``), where grammars begin."""
        name = self.cfg.model.reasoning_parser
        if name is None:
            return None
        try:
            return reasoning_end_ids(self.tokenizer, REASONING_FORMATS[name].end)
        except ValueError as e:
            raise ValidationError(f"--reasoning-parser {name}: {e}", param="reasoning_parser") from None

    def _decode_raw(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""

    # -- the step: schedule -> run -> update ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.overlap:
            return self._step_overlapped()
        self.sessions.expire()
        sched = self.scheduler.schedule()
        self.last_step_ran = bool(sched.reqs)  # False: nothing to compute (waiting on a connector)
        pending = sched.reqs or sched.page_writes or sched.hisparse or self.scheduler.has_pending_kv
        result = self._execute(sched) if pending else None
        return self.scheduler.update(sched, result)

    def _step_overlapped(self) -> list[RequestOutput]:
        """Overlap scheduling (``scheduler/overlap.py``): schedule and launch step N+1, then apply step
        N's result while N+1 runs. Synchronous where N+1 needs N's result first (``needs_sync``), and
        for a step that computes nothing (page-table changes only)."""
        s = self.scheduler
        self.sessions.expire()
        outs = self.wait_in_flight() if s.needs_sync else []
        sched = s.schedule()
        self.last_step_ran = bool(sched.reqs)
        if not sched.reqs:
            outs += self.wait_in_flight()
            pending = sched.page_writes or s.has_pending_kv
            return outs + s.update(sched, self._execute(sched) if pending else None)
        launched = (sched, self._forward.submit(sched))
        overlapped = self._in_flight is not None
        outs += self.wait_in_flight()
        self._in_flight = launched
        if s.needs_sync:
            # The next schedule needs this step's result (drafts, a grammar, ...): wait for it now, so
            # its outputs go out with this step, as in a synchronous step.
            self.overlap_stats["synchronous"] += 1
            outs += self.wait_in_flight()
        elif overlapped:
            self.overlap_stats["overlapped"] += 1
        return outs

    def wait_in_flight(self) -> list[RequestOutput]:
        """Apply the launched step's result (waiting for it); its outputs. Nothing without one."""
        if self._in_flight is None:
            return []
        sched, future = self._in_flight
        self._in_flight = None
        return self.scheduler.update(sched, future.result())

    def _settle_in_flight(self) -> None:
        """Before a control call that needs the engine between steps: the launched step's result is
        applied, its outputs kept for the next step to return."""
        if self._in_flight is not None:
            self.scheduler.keep_outputs(self.wait_in_flight())

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Fault isolation: a failed step is rerun request by request (the failed forward advanced
        nothing, and rewriting the same KV locations is harmless); only the requests that fail alone
        are reported failed, and end with a 500 through the release path."""
        try:
            return self.executor.execute_model(sched)
        except TPGroupBroken:
            raise  # the ranks are out of step: the engine process ends and the front restarts it
        except Exception:
            log.exception("a forward of %d requests failed; running them one by one", len(sched.reqs))
        out = ModelRunnerOutput.empty(len(sched.reqs))
        out.errors = [None] * len(sched.reqs)
        for i in range(len(sched.reqs)):
            try:
                one = self.executor.execute_model(sched.subset(i))
            except Exception as e:
                out.errors[i] = f"{type(e).__name__}: {e}"
                continue
            out.tokens[i], out.logprobs[i], out.top_logprobs[i] = (
                one.tokens[0],
                one.logprobs[0],
                one.top_logprobs[0],
            )
            if one.prompt_logprobs is not None:
                if out.prompt_logprobs is None:
                    out.prompt_logprobs = [[] for _ in sched.reqs]
                    out.prompt_top_logprobs = [[] for _ in sched.reqs]
                out.prompt_logprobs[i] = one.prompt_logprobs[0]
                out.prompt_top_logprobs[i] = one.prompt_top_logprobs[0]
            if one.pooled is not None:
                out.pooled = out.pooled or [None] * len(sched.reqs)
                out.pooled[i] = one.pooled[0]
            if one.label_logprobs is not None:
                out.label_logprobs = out.label_logprobs or [None] * len(sched.reqs)
                out.label_logprobs[i] = one.label_logprobs[0]
            out.finished_sending |= one.finished_sending
            out.finished_recving |= one.finished_recving
        return out

    @staticmethod
    def _limits(cfg: EngineConfig, mc, context: int) -> Limits:
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

    # -- requests ---------------------------------------------------------------------------------------
    def make_request(
        self, input_ids, sampling: dict | None, rid: str | None = None, pooling: PoolingParams | None = None
    ) -> Req:
        """Validate (the engine's copy of the one validation, the authority) and build a request.
        With ``pooling`` it computes its prompt and answers with an embedding or label logprobs
        (``common/pooling.py``): no token is drawn, whatever ``sampling`` says but its cache salt,
        timeout and priority. A grammar starts compiling here, off the engine's thread
        (``req.grammar_job``): the scheduler keeps the request aside until it is compiled, and the
        offline API waits for it (``wait_grammar``)."""
        if pooling is not None:
            validate_pooling(pooling, self.limits.vocab_size)
            sampling = {k: v for k, v in (sampling or {}).items() if k in ("cache_salt", "timeout", "priority")}
            sampling["max_new_tokens"] = 0
        ids, params = validate_request(input_ids, sampling, self.limits)
        rid = rid if rid is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            raise ValidationError("rid must be a non-empty string of at most 256 characters", param="rid")
        req = Req(rid=rid, input_ids=ids, params=params, pooling=pooling)
        if params.lora_path is not None:
            req.lora_key = self.lora_adapter(params.lora_path).fingerprint
        spec = grammar_spec(params)
        if spec is not None:  # compiled on the backend's threads: it holds nothing until it is done
            req.grammar_job = self.grammars.start(spec, after_reasoning=params.require_reasoning)
        return req

    @staticmethod
    def wait_grammar(req: Req) -> None:
        """Block until ``req``'s grammar is compiled (the offline API, on its caller's thread): the
        compile's 400 (or its timeout's) is raised here, before the request is submitted."""
        if req.grammar_job is not None:
            job, req.grammar_job = req.grammar_job, None
            req.grammar = job.wait()

    @staticmethod
    def drop_request(req: Req) -> None:
        """Forget a request built but never submitted (another of its call failed validation)."""
        if req.grammar_job is not None:
            req.grammar_job.cancel()
            req.grammar_job = None

    def submit(self, req: Req, session_params: dict | None = None) -> None:
        """Queue a validated request; with ``session_params`` it becomes a turn of that session.
        Every refusal (409, 429, a session's 400/404/409) happens before anything is held; a PD
        request refused here is reported to its connector, which tells the other side at once."""
        try:
            self.scheduler.check_submit(req)
            if req.pooling is not None:
                if session_params is not None:
                    raise ValidationError(
                        "an embedding or score request cannot be a session turn: it keeps no KV for a next turn",
                        param="session_params",
                    )
                req.disagg = None  # computed here, whatever the server's PD role: there is nothing to send
            if req.disagg is not None:
                self._disagg_params(req, session_params)
            if session_params is not None:
                if req.params.lora_path is not None:
                    raise ValidationError(
                        "a session turn cannot run with a LoRA adapter (yet): a session's KV is not bound "
                        "to one adapter", param="lora_path",
                    )  # fmt: skip
                check_request(self.cfg, "sessions")  # the compatibility table, for a request-level feature
                if req.disagg is not None and self._pd_mode == "prefill":
                    # A session turn through PD, prefill's half: the session is decode's. The request is a
                    # plain one whose prompt decode's claim supplies (``disagg/prefill.py``).
                    self.sessions.check_params(req, session_params)
                else:
                    self._attach(req, session_params)
        except KVLedgerError as e:
            if self.connector is not None and req.disagg is not None:
                self.connector.request_refused(req, e.message)
            raise
        if self.connector is not None:
            self.connector.check_request(req)  # last: it may take the request's room
        self.scheduler.submit(req)

    @property
    def _pd_mode(self) -> str | None:
        return self.cfg.disagg.disaggregation_mode

    def _attach(self, req: Req, session_params: dict) -> None:
        s = self.sessions.sessions.get(session_params.get("id")) if isinstance(session_params, dict) else None
        if s is not None and s.busy_rid is not None:
            # The busy turn may be on its way out (a client that disconnected and retried at once, or
            # a turn that ended while a later launched step held it): let it finish first. Between
            # steps this is a safe point.
            self._settle_in_flight()
            self.scheduler.settle()
        self.sessions.attach(req, session_params, self.limits.context_length)

    def _disagg_params(self, req: Req, session_params: dict | None) -> None:
        """A request with a bootstrap room on a PD server: prefill computes the prompt and one token;
        decode takes the prompt's KV and that token, so it computes no prompt logprobs (the router
        prepends prefill's). On a server that is neither, the room is ignored. A session turn on
        prefill takes its prompt from decode's claim (the session and its history are decode's)."""
        mode = self._pd_mode
        if mode is None:
            req.disagg = None
            return
        if mode == "prefill":
            req.prompt_from_claim = session_params is not None and not req.disagg.fake
            req.params = dataclasses.replace(req.params, max_new_tokens=min(req.params.max_new_tokens, 1))
        else:
            # The body names the prefill server: one this server may not reach is a 400 now, before
            # anything is held or connected (not an address of the client's choosing).
            check_peer = getattr(self.disagg_connector, "check_peer", None)
            if check_peer is not None:
                check_peer(req.disagg)
            req.params = dataclasses.replace(req.params, logprob_start_len=-1)
            req.input_logprobs.clear()
            req.input_top_logprobs.clear()

    def reject(self, rid: str, e: ValidationError) -> RequestOutput:
        """The final output of a request refused before it was queued (engine process)."""
        return RequestOutput.final(rid, FinishReason.from_error(e))

    # -- sessions and control -----------------------------------------------------------------------------
    def open_session(self, session_id: str | None = None, timeout: float | None = None) -> str:
        return self.sessions.open(session_id, timeout)

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def restore_sessions(self, records: list[dict]) -> int:
        """Re-open a previous engine's sessions from their tokens (``server/session_store.py``)."""
        return self.sessions.restore(records, self.limits.vocab_size, self.limits.context_length)

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        self.scheduler.abort(rid, message)

    # -- LoRA adapters -------------------------------------------------------------------------------------
    def lora_adapter(self, name: str):
        """The loaded adapter ``name`` (404 when none is)."""
        adapter = None if self.loras is None else self.loras.adapters.get(name)
        if adapter is None:
            have = sorted(self.loras.adapters) if self.loras is not None else []
            raise NotFoundError(
                f"no LoRA adapter named {name!r} is loaded (loaded: {', '.join(have) or 'none'})",
                param="lora_path", code="lora_not_found",
            )  # fmt: skip
        return adapter

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Read and serve the adapter at ``lora_path`` as ``lora_name`` (400: not servable, a name
        already loaded; nothing changes then)."""
        if self.loras is None:
            raise ValidationError("this server does not serve LoRA adapters: start it with --enable-lora",
                                  param="lora_name", code="lora_disabled")  # fmt: skip
        if not isinstance(lora_name, str) or not lora_name or "=" in lora_name or len(lora_name) > 256:
            raise ValidationError("lora_name must be a non-empty name without '='", param="lora_name")
        if not isinstance(lora_path, str) or not lora_path:
            raise ValidationError("lora_path must be a path", param="lora_path")
        if lora_name in self.loras.adapters:
            raise ValidationError(f"a LoRA adapter named {lora_name!r} is loaded already", param="lora_name",
                                  code="lora_exists")  # fmt: skip
        adapter = read_adapter(lora_name, lora_path, self.loras.max_rank)
        self.loras.add(adapter)
        log.info("LoRA adapter %s loaded from %s (rank %d)", lora_name, lora_path, adapter.rank)
        return adapter.info()

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving ``lora_name``: refused (409) while any request of it is queued or running
        (unload after they end, or abort them); 404 for a name not loaded. Its cached KV stays in
        the prefix cache under its fingerprint (evicted as any), found again if the same files are
        loaded again."""
        self.lora_adapter(lora_name)
        self.scheduler.settle()  # requests already marked to end go first
        users = [r.rid for r in self.scheduler.reqs.values() if r.params.lora_path == lora_name]
        if users:
            raise ConflictError(
                f"{len(users)} request(s) still use LoRA adapter {lora_name!r}; unload it after they end",
                param="lora_name", code="lora_busy",
            )  # fmt: skip
        self.loras.remove(lora_name)
        log.info("LoRA adapter %s unloaded", lora_name)

    def lora_list(self) -> list[dict]:
        return [] if self.loras is None else [a.info() for a in self.loras.adapters.values()]

    # -- pause and weight updates (RL trainers) ------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> int:
        """Stop computing until ``continue_generation`` (``Scheduler.pause`` for the modes); requests
        that arrive meanwhile wait in the queue. Returns how many requests are held paused."""
        if mode not in PAUSE_MODES:
            raise ValidationError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")
        self._settle_in_flight()
        return self.scheduler.pause(mode)

    def continue_generation(self) -> None:
        self.scheduler.resume()

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> dict:
        """Replace the weights with the checkpoint at ``model_path`` (same architecture and shapes,
        ``weights.py``) without a restart. Refused (409) while any request holds KV: computed by
        the old weights, it would be mixed with the new ones (pause with ``retract`` or ``abort``
        first, or let the requests finish). On success the prefix cache is flushed and every
        session's KV dropped (their tokens stay: the next turn recomputes), through the pools'
        books; requests paused by retraction recompute with the new weights when generation
        continues. Any failure leaves the old weights serving, and nothing changed."""
        check_reload_supported(self.cfg)
        s = self.scheduler
        self._settle_in_flight()
        s.settle()  # requests already marked (a pause with mode abort) end first
        held = len(s.running) + len(s.waiting_for_kv) + len(s.sending)
        if held:
            raise ConflictError(
                f"{held} request(s) hold KV computed by the current weights; pause generation with "
                f"mode retract or abort first, or let them finish",
                code="busy",
            )
        t0 = time.monotonic()
        loaded = load_replacement(model_path, load_format, self.model.cfg, self.weight_shapes)
        try:
            model = _sharded_model(self.cfg, loaded, self.model.net.comm, self.dtype, self.cfg.model.device)
        except Exception as e:  # out of memory, a tensor the packing refuses: the old model stays
            log.exception("building the model from %s failed", model_path)
            raise ModelLoadError(
                f"building the model from {model_path} failed ({type(e).__name__}: {e}); "
                f"the old weights still serve"
            ) from None
        del loaded
        if self.loras is not None:
            self.loras.attach(model)  # the adapters serve on the new base weights
        self.model = self.runner.model = model
        if self.runner.graphs is not None:
            self.runner.graphs.set_model(model)  # the graphs hold the old weights' addresses: recapture
        flushed = self.kv_manager.tree.flush()
        dropped = self.sessions.session_kv.drop_all_kv()
        self.cfg = self.cfg.replace(model=model_path)
        self.info.model_path = model_path
        self.info.weight_bytes = model.weight_bytes()
        log.info(
            "weights updated from %s in %.1fs: %d cached pages and %d session tokens of KV dropped; "
            "%d request(s) paused", model_path, time.monotonic() - t0, flushed, dropped, len(s.reqs),
        )  # fmt: skip
        return {"num_paused_requests": len(s.reqs)}

    def connector_stats(self) -> dict | None:
        """The PD transport's counters (None without one)."""
        stats = getattr(self.disagg_connector, "stats", None)
        if stats is None:
            return None
        out = {"mode": self.cfg.disagg.disaggregation_mode, **stats.as_dict()}
        out["authenticated"] = self.disagg_connector.opener.authenticates  # a shared key seals the wire
        if (addr := getattr(self.disagg_connector, "address", None)) is not None:
            out["bootstrap"] = addr  # prefill: where its bootstrap port listens (host:port)
        return out

    def shutdown(self, drain_timeout_s: float = SHUTDOWN_DRAIN_S) -> int:
        """Everything still running ends through the release path, then sessions close; returns
        how many sessions were closed. The drain is bounded: an engine whose work cannot end (a
        transfer whose peer is gone, books a failed step left inconsistent) still closes its
        executor (TP workers) and connector after ``drain_timeout_s``, with an error naming what
        was left, instead of stepping forever."""
        for rid in list(self.scheduler.reqs):
            self.abort(rid, "the engine is shutting down")
        self.drain(drain_timeout_s)
        sids = list(self.sessions.sessions)
        for sid in sids:
            self.close_session(sid)
        self._settle_in_flight()
        if self._forward is not None:
            self._forward.shutdown()
        self.grammars.shutdown()
        self.executor.shutdown()
        close = getattr(self.connector, "close", None)
        if close is not None:
            close()
        return len(sids)

    def drain(self, timeout_s: float) -> bool:
        """Step until the scheduler is idle (requests ended, connector I/O done); False, with an
        error logged, if that takes longer than ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while not self.scheduler.idle:
            if time.monotonic() > end:
                s = self.scheduler
                log.error(
                    "engine: work left after %.0fs of draining (requests %s, connector pending %s): "
                    "closing anyway", timeout_s, sorted(s.reqs)[:10], s.connector.has_pending,
                )  # fmt: skip
                return False
            self.step()
            if not self.last_step_ran:
                time.sleep(0.001)  # only file or transfer I/O left: let its thread have the GIL
        return True

    def flush_cache(self) -> bool:
        """Drop the prefix cache (every tier but the L3 files). Refused (False) while requests run:
        their pages are locked. File I/O still in flight is waited for first."""
        self._settle_in_flight()
        if self.scheduler.has_requests:
            return False
        if self.connector is not None and not self._finish_connector_io():
            return False
        self.kv_manager.tree.flush()
        return True

    def _finish_connector_io(self, timeout_s: float = 60.0) -> bool:
        """Step (no requests: only the connector's async work) until the connector has none in
        flight: under tensor parallelism a file op is done when every rank has reported it, and
        ranks report in steps. Then its own drain. False if that takes longer than ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while self.connector.has_pending:
            if time.monotonic() > end:
                return False
            self.step()
            if not self.last_step_ran:
                time.sleep(0.001)  # only file I/O left: let its thread have the GIL
        return self.connector.drain()

    def memory(self) -> dict:
        m = self.kv_manager.ledger.figures()
        m["num_sessions"] = len(self.sessions.sessions)
        return m

    def audit(self):
        return self.kv_manager.ledger.audit()

    def page_map(self) -> dict:
        """Who owns every page, with the figures, requests, sessions and last audit of the same
        instant (one engine call, so the parts agree): ``/memory/pages`` and the dashboard."""
        ledger = self.kv_manager.ledger
        tree = self.kv_manager.tree
        report = ledger.last_report
        return {
            "page_size": ledger.pages.page_size,
            "num_pages": ledger.pages.num_pages,
            "runs": ledger.page_runs(),
            "memory": self.memory(),
            "requests": [
                {
                    "rid": r.rid,
                    "state": r.state.value,
                    "prompt_tokens": len(r.input_ids),
                    "output_tokens": len(r.output_ids),
                    "kv_tokens": r.kv_len,
                    "pages": len(r.pages) - r.num_out_pages,  # (held: out-of-window entries are not)
                    "session": r.session.id if r.session is not None else None,
                }
                for r in self.scheduler.reqs.values()
            ],
            "sessions": self.sessions.describe(),
            "radix": {
                "nodes": sum(1 for _ in tree.nodes()),
                "pages": tree.evictable_pages + tree.protected_pages,
            },
            "last_audit": None if report is None else {"ok": report.ok, "result": report.describe(limit=5)},
        }

    def graph_stats(self) -> dict | None:
        """The decode graphs' sizes, replays and eager steps by reason (None: no graphs)."""
        g = self.runner.graphs
        return None if g is None else g.stats()

    def rank_stats(self) -> list[dict]:
        """Every rank's ``LlamaModel.compile_stats``, rank 0 first (one entry without TP)."""
        return [{"rank": 0, **self.model.compile_stats()}, *self.executor.worker_stats()]

    def info_dict(self) -> dict:
        return {**dataclasses.asdict(self.info), "loras": self.lora_list()}
