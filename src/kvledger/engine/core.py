"""The engine core: model, pools, scheduler. Runs in-process (offline ``Engine``) or in the engine
process of the server; it is driven by calling ``step``."""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..errors import ConflictError, ValidationError
from ..memory import KVBuffer
from ..model import LlamaModel, load_model
from ..model.linear import QUANTIZATIONS
from ..model.loader import LoadedModel
from ..scheduler import KVManager, Limits, Req, Scheduler, StepOutput, validate_request
from ..scheduler.sessions import SessionManager
from .malloc import keep_heap_memory
from .runner import ModelRunner

log = logging.getLogger(__name__)

DEFAULT_KV_BYTES = 2 * 1024**3  # KV pool size when max_total_tokens is not given (capped by RAM)
DEFAULT_MAX_KV_TOKENS = 262144  # ... and by this many tokens (tiny models would otherwise get millions)


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name in ("float32", "fp32"):
        return torch.float32
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name != "auto":
        raise ValidationError(f"dtype must be auto, bfloat16 or float32, got {name!r}", param="dtype")
    # bf16 matmuls are ~2.5x faster than fp32 where the CPU has native bf16 (PERF-NOTES).
    return torch.bfloat16 if device != "cpu" or cpu_has_bf16() else torch.float32


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 1024**3


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


class EngineCore:
    """Owns one model and one set of pools. No global state: several may live in one process."""

    def __init__(self, cfg: EngineConfig, loaded: LoadedModel | None = None, device: str = "cpu"):
        if cfg.page_size < 1:
            raise ValidationError("page_size must be >= 1", param="page_size")
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if device == "cpu":
            keep_heap_memory()
        t0 = time.monotonic()
        loaded = loaded or load_model(cfg.model)
        mc = loaded.config
        self.dtype = resolve_dtype(cfg.dtype, device)
        if cfg.quantization not in QUANTIZATIONS:
            raise ValidationError(
                f"quantization must be int8, int4 or unset, got {cfg.quantization!r}", param="quantization"
            )
        if cfg.quantization and self.dtype != torch.bfloat16:
            raise ValidationError(f"{cfg.quantization} weights need dtype bfloat16", param="quantization")
        if cfg.quantization == "int4" and device != "cpu":
            raise ValidationError(
                "int4 weights are CPU-only (torch's kernel); use int8", param="quantization"
            )
        self.model = LlamaModel(
            mc, dict(loaded.weights), dtype=self.dtype, device=device, quantization=cfg.quantization
        )
        self.tokenizer = loaded.tokenizer
        ps = cfg.page_size
        per_token = KVBuffer.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        total = cfg.max_total_tokens
        if total is None:
            total = min(min(DEFAULT_KV_BYTES, _ram_bytes() // 5) // per_token, DEFAULT_MAX_KV_TOKENS)
        num_pages = max(1, total // ps)
        total = num_pages * ps
        context = min(cfg.context_length or mc.max_position_embeddings, mc.max_position_embeddings, total)
        self.cfg = cfg.replace(max_total_tokens=total, context_length=context)
        self.kv_buffer = KVBuffer(mc.num_layers, total, mc.num_kv_heads, mc.head_dim, self.dtype, device)
        self.kv = KVManager(
            num_pages=num_pages,
            page_size=ps,
            num_slots=cfg.max_running_requests,
            max_context=context,
            enable_prefix_cache=cfg.enable_prefix_cache,
            strict=cfg.strict_memory,
            holdings=lambda: self.scheduler.holdings(),
        )
        self.runner = ModelRunner(self.model, self.kv_buffer, self.kv.slots.req_to_token, ps, seed=cfg.seed)
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(self.cfg, self.runner, self.kv, context, eos, decode=self._decode_raw)
        self.sessions = SessionManager(self.kv, cfg.max_sessions, cfg.session_timeout_s, ps)
        self.scheduler.sessions = self.sessions
        self.limits = Limits(
            vocab_size=mc.vocab_size,
            context_length=context,
            max_stop_strings=cfg.max_stop_strings,
            max_stop_string_len=cfg.max_stop_string_len,
            max_top_logprobs=cfg.max_top_logprobs,
        )
        if cfg.enable_torch_compile:
            self.model.enable_compile()
            self._warm_up_compile()
        self.info = EngineInfo(
            model_name=mc.name,
            model_path=loaded.path,
            dtype=str(self.dtype).replace("torch.", "")
            + (f"+{cfg.quantization}" if cfg.quantization else ""),
            context_length=context,
            vocab_size=mc.vocab_size,
            page_size=ps,
            max_total_tokens=total,
            kv_bytes_per_token=per_token,
            weight_bytes=self.model.weight_bytes(),
        )
        log.info(
            "engine ready in %.1fs: %s (%s, %s), KV %d tokens in pages of %d (%.0f MiB), context %d",
            time.monotonic() - t0,
            mc.name,
            mc.arch,
            self.info.dtype,
            total,
            ps,
            total * per_token / 2**20,
            context,
        )

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

    def _decode_raw(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""

    # -- requests ---------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValidationError("this model has no tokenizer; send input_ids instead of text", param="text")
        if not isinstance(text, str):
            raise ValidationError("the prompt must be a string", param="text")
        return self.tokenizer.encode(text)

    def make_request(self, input_ids, sampling: dict | None, rid: str | None = None) -> Req:
        """Validate and build a request (allocates nothing)."""
        ids, params = validate_request(input_ids, sampling, self.limits)
        rid = rid if rid is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            raise ValidationError("rid must be a non-empty string of at most 256 characters", param="rid")
        return Req(rid=rid, input_ids=ids, params=params)

    def submit(self, req: Req, session_params: dict | None = None) -> None:
        """Queue a validated request; with ``session_params`` it becomes a turn of that session."""
        if self.scheduler.has_rid(req.rid):
            raise ConflictError(
                f"a request with id {req.rid!r} is already running", param="rid", code="duplicate_rid"
            )
        self.scheduler.check_capacity()
        if session_params is not None:
            s = (
                self.sessions.sessions.get(session_params.get("id"))
                if isinstance(session_params, dict)
                else None
            )
            if s is not None and s.busy_rid is not None:
                # The busy turn may be on its way out (a client that disconnected and retried at once):
                # let pending aborts finish first. Between steps this is a safe point.
                self.scheduler.settle()
            self.sessions.attach(req, session_params, self.limits.context_length)
        self.scheduler.submit(req)

    # -- sessions ---------------------------------------------------------------------------------------
    def open_session(self, session_id: str | None = None, timeout: float | None = None) -> str:
        return self.sessions.open(session_id, timeout)

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        self.scheduler.abort(rid, message)

    def step(self) -> list[StepOutput]:
        self.sessions.expire()
        return self.scheduler.step()

    def flush_cache(self) -> bool:
        """Drop the prefix cache. Refused (False) while requests run: their pages are locked."""
        if not self.scheduler.idle:
            return False
        self.kv.tree.flush()
        return True

    def memory(self) -> dict:
        m = self.kv.ledger.figures()
        m["num_sessions"] = len(self.sessions.sessions)
        return m

    def audit(self):
        return self.kv.ledger.audit()
