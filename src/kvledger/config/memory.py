"""The sections of the KV memory: ``CacheSettings`` (the pool, its pages, the prefix cache, strict
books), ``HiCacheSettings`` (the L2/L3 tiers under the radix tree) and ``HiSparseSettings``."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ValidationError
from .base import (
    KV_CACHE_DTYPES,
    STORAGE_BACKENDS,
    WRITE_POLICIES,
    _norm,
    _one_of,
    _positive,
    setting,
)


@dataclass
class CacheSettings:
    """The KV pool, its pages, the prefix cache and the books."""

    page_size: int = setting(16, "tokens per KV page (default 16; at least 8 with --enable-hisparse)")
    """Tokens per KV page (1 and 16 are both tested). 16 by default, as vLLM's blocks (SGLang's default
    is 1): a request's tokens then lie in runs of 16 consecutive slots, which decode attention reads
    1.4-1.7x faster than one-token pages scattered over the pool (32 streams: 816-829 -> 913-916 tok/s
    offline, 743 -> 800 over HTTP; bench/RESULTS.md); a prefix-cache hit counts whole pages."""
    max_total_tokens: int | None = setting(None, (
        "KV capacity in tokens, rounded down to whole pages (default: sized from the model and the "
        "machine)"
    ))
    kv_cache_dtype: str = setting("auto", (
        "the KV pool's element type: auto (the model's) or fp8_e4m3 (alias fp8: half the bytes, twice "
        "the tokens; attention widens it; on the CPU)"
    ), type=str.lower, choices=(*KV_CACHE_DTYPES, "fp8"))
    """The KV pool's element type. auto: the model's dtype. fp8_e4m3: float8 e4m3 (no scales, as SGLang's
    and vLLM's default fp8 cache: values clamped to +-448), half the bytes of bfloat16: twice the tokens
    in the same memory, and decode attention reads half the bytes (32 decodes over 256 tokens: 12.6 ->
    8.7 ms a step, bench/RESULTS.md). Greedy outputs may differ from auto's after some tokens (measured
    agreement in bench/RESULTS.md). Attention reads it widened to the model's dtype."""
    enable_prefix_cache: bool = setting(True, "radix prefix cache: finished requests' KV kept in the radix tree for reuse by later requests", kind="pair")
    strict_memory: bool = setting(False, "raise on any memory-ledger violation (tests, CI); without it a violation is logged, counted and reclaimed, and the server serves on", kind="switch")
    audit_interval_s: float = setting(10.0, "a full ledger audit at least this often while busy (0: only when idle)")
    """A full audit at a safe point at least this often while the engine is busy (0: only when it
    goes idle); an engine that goes idle is audited then, every time."""
    encoder_cache_bytes: int = setting(64 * 1024 * 1024, "a vision model's encoder-output cache across requests, keyed by image content, in bytes of embeddings (LRU; 0: off)")

    def __post_init__(self) -> None:
        self.kv_cache_dtype = _norm(self.kv_cache_dtype) or "auto"

    def check(self) -> None:
        _positive(self, "page_size", "max_total_tokens")
        _positive(self, "audit_interval_s", "encoder_cache_bytes", allow_zero=True)
        _one_of(self.kv_cache_dtype, KV_CACHE_DTYPES, "kv_cache_dtype")


@dataclass
class HiCacheSettings:
    """The hierarchical cache (SGLang's HiCache): host memory (L2) and files (L3) under the radix cache."""

    enable_hierarchical_cache: bool = setting(False, "back the prefix cache with host memory (L2) and, with a storage backend, files (L3)", kind="switch")
    """Back the radix cache with a host-memory tier (L2) and optionally files (L3): a prefix evicted
    from the KV pool is loaded back instead of recomputed (``hicache/``)."""
    hicache_ratio: float = setting(2.0, "L2 size as a multiple of the KV pool (when --hicache-size is 0)")
    hicache_size: float = setting(0.0, "L2 size in GB (0: use the ratio)")
    hicache_write_policy: str = setting("write_through", "when a prefix is copied to L2: when cached, on its second hit, or when evicted", choices=WRITE_POLICIES)
    """write_through: copy a prefix to L2 when it is cached; write_through_selective: on its second
    hit; write_back: when it is evicted from the KV pool."""
    hicache_storage_backend: str | None = setting(None, "an L3 tier: one file per KV page under --hicache-storage-dir (survives restarts)", choices=STORAGE_BACKENDS)
    hicache_storage_dir: str | None = setting(None, "where L3 files live (made 0700)")
    hicache_salt: str | None = setting(None, "per-deployment salt of the page keys (default: a random one kept in the storage dir)")
    hicache_load_back_threshold: int = setting(16, "L2 matches shorter than this many tokens are recomputed")
    hicache_prefetch_threshold: int = setting(64, "L3 hits shorter than this many tokens are not prefetched")
    hicache_prefetch_timeout_s: float = setting(2.0, "seconds a queued request waits for its L3 prefetch", flags=("--hicache-prefetch-timeout",))

    def __post_init__(self) -> None:
        self.hicache_write_policy = _norm(self.hicache_write_policy) or "write_through"
        self.hicache_storage_backend = _norm(self.hicache_storage_backend, null=("none", "null"))

    def check(self) -> None:
        if not self.enable_hierarchical_cache:
            if self.hicache_storage_backend is not None:
                raise ValidationError(
                    "--hicache-storage-backend needs --enable-hierarchical-cache", param="hicache_storage_backend"
                )
            return
        _one_of(self.hicache_write_policy, WRITE_POLICIES, "hicache_write_policy")
        _one_of(self.hicache_storage_backend, STORAGE_BACKENDS, "hicache_storage_backend", optional=True)
        if not self.hicache_ratio > 0 or self.hicache_size < 0:
            raise ValidationError("hicache_ratio must be > 0 and hicache_size >= 0", param="hicache_ratio")
        _positive(self, "hicache_load_back_threshold", "hicache_prefetch_threshold", allow_zero=True)
        _positive(self, "hicache_prefetch_timeout_s")
        # Whether the directory can be used is the disk's question: hicache/storage.py's
        # check_storage_dir, run by the composition root (launch/validate.py) after this one.
        if self.hicache_storage_backend == "file" and not self.hicache_storage_dir:
            raise ValidationError("the file storage backend needs --hicache-storage-dir", param="hicache_storage_dir")


@dataclass
class HiSparseSettings:
    """Sparse decode attention over a hot page budget (SGLang's HiSparse), pages chosen as Quest does."""

    enable_hisparse: bool = setting(False, (
        "sparse decode attention for long prompts: the whole KV in a host pool, the pages each step "
        "reads (Quest's choice) in a per-request hot budget"
    ), kind="switch")
    """A request whose prompt has at least hisparse_min_context tokens decodes sparsely: its whole KV
    lives in a host pool, and each step attention reads only the selected pages, kept in a fixed
    budget of hot pages in the KV pool (``memory/sparse_kv.py``, ``model/hisparse.py``)."""
    hisparse_top_k_pages: int = setting(16, "pages each layer and KV head reads besides the sink and recent ones (Quest's bound picks them)")
    hisparse_hot_pages: int = setting(32, "KV-pool pages per sparse request (at least sink + recent + top-k)")
    """KV-pool pages per sparse request: one takes the page being written, the rest cache selected
    pages (LRU per layer and KV head). At least sink + recent + top-k."""
    hisparse_budget_tokens: int = setting(0, (
        "tokens each sparse layer and KV head reads besides the sink and recent pages, as pages "
        "(budget // page size; 0: --hisparse-top-k-pages decides)"
    ))
    """A budget in tokens instead of pages: ``hisparse_budget_tokens // page_size`` top-k pages
    (``top_k_pages``). The sink pages, the recent ones and the page being written are read besides."""
    hisparse_dense_layers: int = setting(2, "the first layers attend densely (every page, read in place)")
    """The first layers read every page (Quest: their attention is not sparse); on the CPU from the host
    pool in place, like the sparse layers' selected pages."""
    hisparse_min_context: int = setting(2048, "prompts shorter than this attend densely")
    hisparse_sink_pages: int = setting(1, "the first pages every step reads")
    hisparse_recent_pages: int = setting(2, "the last pages every step reads (the one being written included)")
    hisparse_host_ratio: float = setting(2.0, "the HiSparse host pool's size as a multiple of the KV pool")

    def check(self) -> None:
        if not self.enable_hisparse:
            return
        _positive(self, "hisparse_top_k_pages", "hisparse_hot_pages", "hisparse_recent_pages")
        _positive(self, "hisparse_min_context", "hisparse_sink_pages", "hisparse_budget_tokens",
                  "hisparse_dense_layers", allow_zero=True)  # fmt: skip
        if self.hisparse_budget_tokens:
            return  # the hot pages against the budget's pages: check_hisparse_budget (knows the page size)
        if not self.hisparse_host_ratio > 0:
            raise ValidationError("hisparse_host_ratio must be > 0", param="hisparse_host_ratio")
        need = self.hisparse_sink_pages + self.hisparse_recent_pages + self.hisparse_top_k_pages
        if self.hisparse_hot_pages < need:
            raise ValidationError(
                f"hisparse_hot_pages ({self.hisparse_hot_pages}) must hold the pages a step reads: sink "
                f"{self.hisparse_sink_pages} + recent {self.hisparse_recent_pages} + top-k "
                f"{self.hisparse_top_k_pages} = {need}",
                param="hisparse_hot_pages",
            )

    def top_k_pages(self, page_size: int) -> int:
        """The pages each sparse layer and KV head selects: the budget's whole pages where a budget in
        tokens is set, else ``hisparse_top_k_pages``."""
        if self.hisparse_budget_tokens:
            return self.hisparse_budget_tokens // page_size
        return self.hisparse_top_k_pages

    def check_budget(self, page_size: int) -> None:
        """The budget in tokens against the page size: at least one page, and hot pages for it."""
        if not self.enable_hisparse or not self.hisparse_budget_tokens:
            return
        if self.hisparse_budget_tokens < page_size:
            raise ValidationError(
                f"hisparse_budget_tokens ({self.hisparse_budget_tokens}) must be at least one page "
                f"({page_size} tokens)",
                param="hisparse_budget_tokens",
            )
        need = self.hisparse_sink_pages + self.hisparse_recent_pages + self.top_k_pages(page_size)
        if self.hisparse_hot_pages < need:
            raise ValidationError(
                f"hisparse_hot_pages ({self.hisparse_hot_pages}) must hold the pages a step reads: sink "
                f"{self.hisparse_sink_pages} + recent {self.hisparse_recent_pages} + the budget's "
                f"{self.top_k_pages(page_size)} pages = {need}",
                param="hisparse_hot_pages",
            )
