"""The settings: ``EngineConfig`` in sections (as vLLM splits its config), and ``ServerConfig``.

Each section is a dataclass with its own ``check()`` (the values a section can judge alone) and
normalises its enum-like values once, where they enter (``__post_init__``): ``"standalone"`` and
``"STANDALONE"`` are one algorithm from then on, and nothing outside this module compares raw
spellings. Which features combine is not a section's business: ``compat.py`` owns that table, and
``EngineConfig.check`` runs the sections' checks, then the table.

Each setting is declared once, here: a field made with ``setting(default, help, ...)`` gives its name,
type, default, section (its class), help and how its flag parses (``Flag``). argparse and ``kvledger
serve --help`` (cli.py) and docs/settings.md (``settings_markdown``; ``python -m kvledger.config
--write``) are generated from these fields. A field's docstring says why its default is what it is.

Field names are the CLI flags' (``--page-size`` <-> ``cache.page_size``), so the flat view
(``EngineConfig.from_flat`` / ``flat``) that the CLI, the offline ``Engine(**kwargs)``, the engine
process and ``/get_server_info`` speak maps 1:1 onto the sections.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar

from .errors import ValidationError

# The allowed values of the enum-like settings (their subsystems import them from here).
DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
ATTENTION_BACKENDS = ("auto", "torch", "cpu")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # SGLang's and vLLM's names (vLLM's "fp8" is e4m3: an alias)
CPU_AMX = ("auto", "on", "off")
SAMPLING_BACKENDS = ("auto", "host", "device")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
DISAGGREGATION_MODES = ("prefill", "decode")
TRANSFER_BACKENDS = ("tcp", "mooncake")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
STORAGE_BACKENDS = ("file",)
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")  # SGLang's names (scheduler/queue_order.py)
REASONING_PARSERS = ("deepseek-r1", "qwen3")  # SGLang's names (server/reasoning.py has their formats)
CHAT_TEMPLATES = ("chatml", "llama-3", "gemma", "mistral", "phi-3", "qwen")  # model/chat_templates.BUILTIN_TEMPLATES' names (a test keeps them equal)
TOOL_CALL_PARSERS = ("hermes", "llama3", "mistral", "qwen", "qwen25")  # server/tools.PARSERS' names (a test keeps them equal)
POOLINGS = ("last", "mean")  # common/pooling.POOLING_METHODS (a test keeps them equal)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")  # sglang-router's
DIST_AUTH_KEY_ENV = "KVLEDGER_DIST_AUTH_KEY"  # the tensor-parallel group's key, where no key file is given
# Overlap scheduling on the CPU when --disable-overlap-schedule is not given (bench/overlap.py).
CPU_OVERLAP_DEFAULT = False
# --interleave-prefill-tokens on the CPU when not given (bench/RESULTS.md, "Prefill while decoding").
CPU_INTERLEAVE_PREFILL_TOKENS = 512
"""The prefill budget between decode steps on a CPU with AMX tiles (prefill ~3,500 tok/s on 2 cores)."""
CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX = 128
"""The same without AMX (AVX-512 VNNI/BF16 kernels; an AMD Zen 4's prefill runs at ~1,600-1,900 tok/s,
half the AMX box's): 32 streams of 128+128 tokens, vLLM's client, two runs each side by side on 2 Zen 4
cores: TTFT p50 0.24-0.37 s and 504-506 tok/s at 128 against 0.60-0.71 s and 509-563 at 512 (256:
0.37-0.43 s, 491-497 tok/s; bench/RESULTS.md)."""
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "fp8_e4m3"}


def cpu_interleave_default() -> int:
    """The CPU's prefill budget between decode steps: a prefill step of ~0.1-0.15 s on either kind of
    CPU (``CPU_INTERLEAVE_PREFILL_TOKENS`` with AMX tiles, ``..._NO_AMX`` without)."""
    from .model.linear import amx_available  # (lazily: config stays importable without torch)

    return CPU_INTERLEAVE_PREFILL_TOKENS if amx_available() else CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX


def _norm(value: str | None, *, upper: bool = False, null: tuple[str, ...] = ()) -> str | None:
    """One spelling of an enum-like value: stripped, one case, aliases resolved; ``null`` spellings
    (SGLang's ``null`` for "off") become None."""
    if value is None:
        return None
    v = str(value).strip()
    v = v.upper() if upper else v.lower()
    if v in null:
        return None
    return _ALIASES.get(v, v)


def _one_of(value, allowed: tuple, param: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in allowed:
        extra = " or unset" if optional else ""
        raise ValidationError(f"{param} must be one of {', '.join(allowed)}{extra}, got {value!r}", param=param)


def _positive(section, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        v = getattr(section, name)
        if v is None:
            continue
        if v < 0 or (v == 0 and not allow_zero):
            raise ValidationError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {v}", param=name)


# -- Each setting declared once (issue 53): a dataclass field whose metadata says how its flag parses ----
# The field gives the name, the type, the default and (by its class) the section; ``setting`` adds the
# help and the flag's shape. argparse (cli.py), ``kvledger serve --help`` and docs/settings.md are all
# generated from these fields; tests/unit/test_cli_surface.py pins the flags they make.
VALUE, SWITCH, PAIR, TRISTATE = "value", "switch", "pair", "tristate"


@dataclass(frozen=True)
class Flag:
    """How a setting is given on the command line."""

    help: str
    flags: tuple[str, ...] = ()
    """Its option strings, the first the main one; (): ``--the-name`` (a pair: ``--enable-x``/``--disable-x``)."""
    kind: str = VALUE
    """value: ``--x V``; switch: ``--x`` sets True; pair: ``--enable-x``/``--disable-x`` set True/False;
    tristate: ``--disable-x``/``--enable-x`` set True/False, neither leaves None (the default)."""
    type: Callable[[str], Any] | None = None
    """How the value parses; None: the field's type (int, float; a string as given)."""
    choices: tuple | None = None
    nargs: str | None = None
    metavar: str | None = None
    help2: str | None = None
    """A pair's or tristate's second option's help."""

    def options(self, name: str) -> tuple[str, ...]:
        if self.flags:
            return self.flags
        if self.kind == PAIR:
            base = name.removeprefix("enable_").replace("_", "-")
            return (f"--enable-{base}", f"--disable-{base}")
        return ("--" + name.replace("_", "-"),)


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A setting's one declaration: its ``default``, its ``help`` and its flag's shape (``Flag``)."""
    return field(default=default, metadata={"flag": Flag(help, **flag)})


def declared(cls: type) -> list[tuple[Field, Flag]]:
    """The settings of a section (or of ``ServerConfig``, ``LaunchSettings``) with their flags, in order."""
    return [(f, f.metadata["flag"]) for f in fields(cls) if "flag" in f.metadata]


def value_type(f: Field) -> Callable[[str], Any] | None:
    """The parser of a value setting's flag from its annotation: int, float, else the string as given."""
    base = str(f.type).split("|")[0].strip()
    return {"int": int, "float": float}.get(base)


@dataclass
class ModelSettings:
    """What runs, where, in which precision."""

    model: str | None = setting(None, "GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)", flags=("--model", "--model-path"))
    device: str = setting("cpu", "cpu (default) | cuda | cuda:N | auto (a CUDA device where torch sees one, else cpu)")
    """cpu | cuda | cuda:N | auto (the first CUDA device where torch sees one, else the CPU). On CUDA
    the model runs in torch (SDPA attention, bf16 GEMMs; weights served unquantized) and sampling
    stays on the host. The default stays cpu: a GPU is opt-in."""
    dtype: str = setting("auto", (
        "auto (default: the faster one on this machine) | float32 (the token-exact reference) | "
        "bfloat16"
    ), choices=DTYPES)
    quantization: str | None = setting("auto", (
        "weight-only int8 / int4 linear layers in GGUF's blocks of 32 (Q8_0 / Q4_1-exact; CPU only, "
        "needs bfloat16). auto (default): a quantized GGUF in its own precision (Q4 -> int4, Q5-Q8 -> "
        "int8) when the dtype is bfloat16"
    ), choices=QUANTIZATIONS)
    """auto | none | int8 | int4. Weight-only quantized linear layers in GGUF's blocks of 32 (int4 =
    Q4_1: a Q4_1 file's own weights; int8 = Q8_0; the LM head stays int8), CPU only, needs bfloat16.
    Where kvledger's CPU kernels load they serve every forward (int8 activations per block of 32,
    llama.cpp's scheme; faster than the bf16 GEMM at every batch size here); otherwise torch's
    weight-only kernels serve forwards of at most 4 rows and the bf16 GEMM the rest.
    auto: the checkpoint's own precision where the dtype is bfloat16 (a Q4 GGUF -> int4, Q5/Q6/Q8 ->
    int8, float checkpoints none); none with float32. Output within the tolerance in
    docs/architecture.md, not token-exact. None = none."""
    context_length: int | None = setting(None, "longest sequence, prompt + output (default: the model's own limit)")
    reasoning_parser: str | None = setting(None, (
        "the model's reasoning markers (<think>...</think>): chat answers give them as "
        "reasoning_content, and a request's grammar starts after </think>"
    ), choices=REASONING_PARSERS)
    """None | deepseek-r1 | qwen3: how the model marks its reasoning (``<think>``...``</think>``). The
    chat API then answers it as ``reasoning_content``, and a request's grammar (structured output,
    tool calls) starts after the end of the reasoning (the engine gates it on ``</think>``'s ids)."""

    chat_template: str | None = setting(None, (
        "the chat template: a Jinja file, or a built-in (" + ", ".join(CHAT_TEMPLATES) + "); default: "
        "the model's own (a GGUF's tokenizer.chat_template, else the Hugging Face tokenizer config)"
    ), metavar="FILE|NAME")
    """A Jinja file or a built-in name (``model/chat_templates.py``), for a model that carries no template
    (or the wrong one). It wins over the model's own; read and tried once at start (a bad one stops the
    start). Its end-of-turn tokens (``<end_of_turn>``, ``<|im_end|>``, ``<|eot_id|>``...) stop generation."""

    def __post_init__(self) -> None:
        self.device = _norm(self.device) or "cpu"
        self.dtype = _norm(self.dtype) or "auto"
        self.quantization = _norm(self.quantization, null=("none",))
        self.reasoning_parser = _norm(self.reasoning_parser, null=("none", "null", ""))

    @property
    def explicit_quantization(self) -> str | None:
        """The quantization asked for by name (int8/int4), before ``auto`` is resolved against a model."""
        return self.quantization if self.quantization in ("int8", "int4") else None

    def check(self) -> None:
        _one_of(self.dtype, DTYPES, "dtype")
        _one_of(self.quantization, QUANTIZATIONS, "quantization", optional=True)
        _one_of(self.reasoning_parser, REASONING_PARSERS, "reasoning_parser", optional=True)
        if self.chat_template is not None and not str(self.chat_template).strip():
            raise ValidationError(
                f"chat_template must be a file or one of {', '.join(CHAT_TEMPLATES)}, got ''", param="chat_template"
            )
        _positive(self, "context_length")


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

    def __post_init__(self) -> None:
        self.kv_cache_dtype = _norm(self.kv_cache_dtype) or "auto"

    def check(self) -> None:
        _positive(self, "page_size", "max_total_tokens")
        _positive(self, "audit_interval_s", allow_zero=True)
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
        if self.hicache_storage_backend == "file":
            if not self.hicache_storage_dir:
                raise ValidationError(
                    "the file storage backend needs --hicache-storage-dir", param="hicache_storage_dir"
                )
            from .hicache.storage import check_storage_dir  # the one check that touches the disk

            check_storage_dir(self.hicache_storage_dir, salt_kept=not self.hicache_salt)


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
    hisparse_min_context: int = setting(2048, "prompts shorter than this attend densely")
    hisparse_sink_pages: int = setting(1, "the first pages every step reads")
    hisparse_recent_pages: int = setting(2, "the last pages every step reads (the one being written included)")
    hisparse_host_ratio: float = setting(2.0, "the HiSparse host pool's size as a multiple of the KV pool")

    def check(self) -> None:
        if not self.enable_hisparse:
            return
        _positive(self, "hisparse_top_k_pages", "hisparse_hot_pages", "hisparse_recent_pages")
        _positive(self, "hisparse_min_context", "hisparse_sink_pages", allow_zero=True)
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


@dataclass
class SchedulerSettings:
    """Admission, batching, sessions and per-request limits."""

    chunked_prefill_size: int = setting(2048, "most prompt tokens one forward pass takes, all requests together; longer prompts are chunked")
    """Most prompt tokens one forward pass takes (all requests together); longer prompts are chunked.
    2048 as vLLM's default token budget: on the CPU a 1,024-token prompt in one pass took 280-296 ms
    against 323-336 in two of 512 (one causal attention instead of a masked second chunk), and a burst
    of 32 128-token prompts was no slower (bench/RESULTS.md); running decodes wait out a larger pass."""
    max_running_requests: int = setting(64, "most requests decoding at once (also the number of request slots)")
    max_queued_requests: int = setting(256, "most requests waiting for admission; past it a 429")
    max_queued_prefill_tokens: int | None = setting(None, "most prompt tokens waiting for admission; an arrival past it gets a 429 (default: no budget)")
    """Most prompt tokens waiting for admission (the prefill work queued); an arrival that would push
    them past it is refused (429) unless nothing waits. None: no budget, only max_queued_requests."""
    request_timeout_s: float | None = setting(None, "seconds a request may take, queued and running; past it it ends with a 503 (default: off)")
    """Seconds a request may take from its arrival, queued and running together; past it it ends with
    a 503 (SGLang's waiting/running timeouts). A request's own ``timeout`` may only shorten it. None: off."""
    interleave_prefill_tokens: int | None = setting(None, (
        "while requests decode, the most prompt tokens a step brings, then a decode step runs (first "
        f"tokens sooner under bursts); 0: prefill first (default: {CPU_INTERLEAVE_PREFILL_TOKENS} on a "
        f"CPU with AMX, {CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX} on other CPUs, 0 on CUDA)"
    ))
    """While requests decode, the most prompt tokens one step brings; unmixed, such a prefill step is
    followed by a decode step. Running streams then advance between a burst's chunks, and the burst's
    requests start decoding (and end, and are replaced) a chunk apart instead of all together: under
    closed-loop arrival the next wave's prompts come a few at a time and wait one short chunk, not the
    whole wave's prefill. 0: prefill first (every waiting prompt, ``chunked_prefill_size`` tokens a
    step, before the next decode step: SGLang's order). None: ``cpu_interleave_default()`` on the
    CPU (512 with AMX tiles, 128 without), 0 on CUDA. With mixed chunks it caps a mixed step's prefill part. Measured on the CPU, 32
    streams of 128+128 tokens: TTFT p50 halved (0.56-0.60 s -> 0.31-0.34 s) for 3-8% fewer tokens
    per second (bench/RESULTS.md)."""
    enable_mixed_chunk: bool = setting(False, (
        "prefill chunks and decodes in one forward: first tokens sooner under bursts, running streams "
        "wait for the chunk"
    ), kind="pair")
    """Run a prefill chunk and the running decodes in one forward pass. Off by default, as in SGLang:
    on a burst of new requests it halves TTFT p50 but multiplies the running requests' ITL p99 by ~6
    and costs ~4% throughput (bench/mixed_chunk.py, bench/RESULTS.md)."""
    disable_overlap_schedule: bool | None = setting(None, (
        "schedule each step after the previous one's result (default: overlapped on CUDA; on the CPU "
        "as measured, bench/RESULTS.md); --enable-overlap-schedule: prepare step N+1 while step N "
        "runs, on the CPU too"
    ), kind="tristate", flags=("--disable-overlap-schedule", "--enable-overlap-schedule"))
    """SGLang's ``--disable-overlap-schedule``. Overlap scheduling prepares step N+1 while step N runs
    (on a forward thread), from placeholders for step N's tokens (scheduler/overlap.py). None: on for
    CUDA, and on the CPU as ``CPU_OVERLAP_DEFAULT`` says (measured: bench/overlap.py). It runs
    synchronously under tensor parallelism and with a KV connector (PD, hierarchical cache), and a
    step after one with drafts, grammars, prompt logprobs or pooling waits for it."""
    max_sessions: int = setting(64, "most open streaming sessions")
    session_timeout_s: float | None = setting(600.0, "idle sessions are closed after this many seconds (a session's own timeout wins)")
    max_stop_strings: int = setting(16, "most stop strings (and stop_regex patterns) a request may give")
    max_stop_string_len: int = setting(256, "longest stop string or stop_regex pattern, in characters")
    max_top_logprobs: int = setting(20, "most alternatives a request may ask per token (top_logprobs)")
    max_grammar_len: int = setting(65536, "longest grammar a request may give (json_schema, regex, ebnf), in characters")
    max_grammar_depth: int = setting(32, "deepest nesting of a grammar (a schema's objects and arrays, a regex's or EBNF's groups)")
    grammar_compile_timeout_s: float = setting(30.0, "seconds a grammar may take to compile (off the engine's thread); past it a 400")
    """Seconds a grammar may take to compile (on the grammar threads, never the engine's); past it the
    request is refused with a 400 (code grammar_compile_timeout)."""
    seed: int = setting(0, "seed of the engine's generator for requests that bring no seed of their own")
    schedule_policy: str = setting("fcfs", (
        "order of the waiting queue: fcfs (arrival), lpm (longest prefix-cache match first), "
        "dfs-weight (radix subtrees with most waiting requests first)"
    ), type=str.lower, choices=SCHEDULE_POLICIES)
    """Order of the waiting queue (SGLang's ``--schedule-policy``): ``fcfs`` arrival; ``lpm`` longest
    prefix-cache match first; ``dfs-weight`` depth-first over the radix tree, heavier subtrees (more
    waiting requests) first. With priority scheduling the priority comes first in every policy."""
    enable_priority_scheduling: bool = setting(False, (
        "order waiting requests by their priority (larger is more important) and let one preempt "
        "lower-priority running requests when the pool or slots are full"
    ), kind="switch")
    """Order the waiting queue by each request's ``priority`` (then the policy), and let a request
    preempt (retract) running ones whose priority is lower by more than the threshold when the pool
    or the running slots are full. Off: a request's ``priority`` is ignored, as in SGLang."""
    schedule_low_priority_values_first: bool = setting(False, "with --enable-priority-scheduling: smaller priority values are more important", kind="switch")
    priority_scheduling_preemption_threshold: int = setting(10, "preempt a running request only for a priority higher by more than this (default 10)")
    """A running request is preempted only by one whose priority is higher by more than this (SGLang's
    default, 10)."""
    abort_on_priority_when_disabled: bool = setting(False, (
        "without --enable-priority-scheduling, refuse (503) a request that sends a priority instead "
        "of ignoring it"
    ), kind="switch")
    """Without priority scheduling, refuse a request that sends a ``priority`` (503, as SGLang) instead
    of ignoring it."""

    def __post_init__(self) -> None:
        self.schedule_policy = _norm(self.schedule_policy) or "fcfs"

    def overlap_wanted(self, device: str) -> bool:
        """Overlap scheduling as the settings ask for it on ``device`` (the engine still runs
        synchronously under TP and with a KV connector: ``engine/core.overlap_schedule``)."""
        if self.disable_overlap_schedule is None:
            return device.startswith("cuda") or CPU_OVERLAP_DEFAULT
        return not self.disable_overlap_schedule

    def interleave_tokens(self, device: str) -> int:
        """``interleave_prefill_tokens`` on ``device`` (0: prefill first)."""
        if self.interleave_prefill_tokens is None:
            return 0 if device.startswith("cuda") else cpu_interleave_default()
        return self.interleave_prefill_tokens

    @property
    def cache_aware_policy(self) -> bool:
        """The waiting queue is ordered by what the prefix cache holds (lpm, dfs-weight)."""
        return self.schedule_policy != "fcfs"

    def check(self) -> None:
        _one_of(self.schedule_policy, SCHEDULE_POLICIES, "schedule_policy")
        # A negative threshold would let equal priorities preempt each other back and forth.
        _positive(self, "priority_scheduling_preemption_threshold", allow_zero=True)
        _positive(self, "chunked_prefill_size", "max_running_requests", "max_queued_requests", "session_timeout_s")
        _positive(self, "max_queued_prefill_tokens", "request_timeout_s")
        _positive(self, "interleave_prefill_tokens", allow_zero=True)
        if self.request_timeout_s is not None and not math.isfinite(self.request_timeout_s):
            raise ValidationError("request_timeout_s must be a finite number of seconds", param="request_timeout_s")
        _positive(self, "max_sessions", "max_stop_strings", "max_stop_string_len", "max_top_logprobs", allow_zero=True)
        _positive(self, "max_grammar_len", "max_grammar_depth", "grammar_compile_timeout_s")
        if not math.isfinite(self.grammar_compile_timeout_s):
            raise ValidationError(
                "grammar_compile_timeout_s must be a finite number of seconds", param="grammar_compile_timeout_s"
            )


@dataclass
class ParallelSettings:
    """Tensor parallelism over processes and machines, and the cores each rank uses."""

    tp_size: int = setting(1, "tensor parallel ranks (processes over torch.distributed: gloo on CPUs)", flags=("--tp-size", "--tensor-parallel-size"))
    nnodes: int = setting(1, "machines the TP ranks span (tp_size / nnodes ranks on each; node 0 serves HTTP)")
    node_rank: int = setting(0, "this machine's index (0 serves HTTP)")
    dist_init_addr: str | None = setting(None, "host:port of node 0's rendezvous (node 0 listens on that address only)")
    """host:port of rank 0's rendezvous (multi-node): node 0 listens there only, the others connect;
    None: a free port on 127.0.0.1."""
    dist_auth_key_file: str | None = setting(None, (
        "the key every TP rank proves before the group forms (same file on every node; or "
        "KVLEDGER_DIST_AUTH_KEY); needed with --nnodes > 1"
    ))
    """A file holding the key every rank proves before the group forms (the same file on every node;
    or ``KVLEDGER_DIST_AUTH_KEY``); needed with several nodes, on one machine a random key per launch."""
    dist_timeout_s: float = setting(24 * 3600.0, "seconds a collective may wait (idle ranks wait in one for the next step)", flags=("--dist-timeout",))
    """How long a collective may wait. Idle workers wait in one for the next step, so this is long; a
    rank that dies breaks its connections at once, and a hung one is the front's watchdog's to catch."""
    num_threads: int | None = setting(None, "torch intra-op threads (default: torch's, shared out between ranks)")

    def check(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValidationError("tp_size must be a positive multiple of nnodes", param="tp_size")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValidationError(f"node_rank must be in [0, {self.nnodes})", param="node_rank")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValidationError("several nodes need --dist-init-addr host:port (node 0's)", param="dist_init_addr")
        if self.nnodes > 1 and not (self.dist_auth_key_file or os.environ.get(DIST_AUTH_KEY_ENV)):
            raise ValidationError(
                f"several nodes need a shared key: --dist-auth-key-file PATH (or {DIST_AUTH_KEY_ENV})",
                param="dist_auth_key_file",
            )
        _positive(self, "dist_timeout_s", "num_threads")


@dataclass
class SpeculativeSettings:
    """Speculative decoding: who drafts, how many tokens."""

    speculative_algorithm: str | None = setting(None, "speculative decoding: NGRAM (the request's own text) or STANDALONE (a draft model)", type=str.upper, choices=SPECULATIVE_ALGORITHMS)
    """None | NGRAM | STANDALONE (any case). NGRAM drafts from the request's own prompt and output
    (spec/ngram.py), STANDALONE with a small draft model (spec/draft_model.py); the drafts are verified
    in the same forward as everything else, output distribution unchanged."""
    speculative_draft_model_path: str | None = setting(None, "STANDALONE: the draft model (GGUF or HF directory) of the same tokenizer")
    speculative_num_draft_tokens: int = setting(4, "most drafts one request verifies per step (1-16)")
    speculative_ngram_min_match_window_size: int = setting(1, "NGRAM: the shortest suffix, in tokens, that must have occurred before", flags=("--speculative-ngram-min-match-window-size", "--speculative-ngram-min-match-window"))
    speculative_ngram_max_match_window_size: int = setting(12, "NGRAM: the longest suffix, in tokens, tried first", flags=("--speculative-ngram-max-match-window-size", "--speculative-ngram-max-match-window"))

    def __post_init__(self) -> None:
        self.speculative_algorithm = _norm(self.speculative_algorithm, upper=True, null=("NONE", "NULL", ""))

    @property
    def draft_model(self) -> bool:
        """A draft model (STANDALONE): its own weights and K/V."""
        return self.speculative_algorithm == "STANDALONE"

    def check(self) -> None:
        algo = self.speculative_algorithm
        _one_of(algo, SPECULATIVE_ALGORITHMS, "speculative_algorithm", optional=True)
        if algo is None:
            return
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            raise ValidationError(
                "speculative_num_draft_tokens must be in [1, 16]", param="speculative_num_draft_tokens"
            )
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValidationError(
                f"need 1 <= speculative_ngram_min_match_window_size ({lo}) <= ..._max_match_window_size ({hi})",
                param="speculative_ngram_min_match_window_size",
            )
        path = self.speculative_draft_model_path
        if self.draft_model and (not path or not os.path.exists(path)):
            raise ValidationError(
                f"STANDALONE needs --speculative-draft-model-path to an existing model (got {path!r})",
                param="speculative_draft_model_path",
            )


@dataclass
class DisaggregationSettings:
    """Prefill/decode disaggregation behind SGLang's router (``disagg/``)."""

    disaggregation_mode: str | None = setting(None, "this server's part behind sglang-router --pd-disaggregation (default: null, neither)", choices=("null", *DISAGGREGATION_MODES))
    """None | prefill | decode: this server's part. Requests without a bootstrap room are served whole
    either way."""
    disaggregation_bootstrap_port: int = setting(8998, "prefill: where decode servers fetch KV; decode: the port assumed if the router gives none")
    """prefill: the port decode servers fetch KV from; decode: the port assumed when the router
    passes none."""
    disaggregation_bind_host: str = setting("127.0.0.1", (
        "prefill: the address the bootstrap port binds (default: 127.0.0.1; another needs "
        "--disaggregation-auth-key-file); mooncake: the address its engine announces"
    ))
    """prefill: the address the bootstrap port binds (loopback unless set: a bootstrap port reachable
    from other machines is a decision, and needs ``disaggregation_auth_key_file``); with Mooncake, the
    address each side's transfer engine announces."""
    disaggregation_transfer_backend: str = setting("tcp", "tcp: the built-in KV transport (ZMQ over TCP); mooncake: Mooncake's transfer engine (TCP)", choices=TRANSFER_BACKENDS)
    disaggregation_bootstrap_timeout_s: float = setting(300.0, (
        "prefill: release a request's KV if no decode server claims and acknowledges it in this long "
        "(seconds)"
    ), flags=("--disaggregation-bootstrap-timeout",))
    """prefill: how long a finished request's KV waits for its decode server to claim and
    acknowledge it before it is released."""
    disaggregation_waiting_timeout_s: float = setting(300.0, "decode: fail (502) and release a request whose KV has not arrived in this long (seconds)", flags=("--disaggregation-waiting-timeout",))
    disaggregation_auth_key_file: str | None = setting(None, (
        "the key the PD nodes share (the same file on every prefill and decode server, at least 32 "
        "bytes): every PD message is sealed with an HMAC under it (default: "
        "$KVLEDGER_DISAGGREGATION_AUTH_KEY, else none: loopback only)"
    ), metavar="PATH")
    """A file holding the key the PD nodes share (at least 32 bytes; the same on every prefill and
    decode server): every message between them is sealed with an HMAC under it (``disagg/auth.py``).
    None: the environment variable ``KVLEDGER_DISAGGREGATION_AUTH_KEY``, else no key, which only a
    server whose PD sockets are all on loopback may run without."""
    disaggregation_prefill_peers: list[str] | None = setting(  # noqa: RUF009 (a declaration: default None)
        None, (
        "decode: the prefill bootstrap addresses it may fetch KV from, as the router names them; "
        "another is a 400 (default: 127.0.0.1 / localhost at --disaggregation-bootstrap-port)"
    ), nargs="+", metavar="HOST:PORT")
    """decode: the prefill bootstrap addresses (``host:port``, as the router names them: the host of
    each ``--prefill URL`` and its bootstrap port) this server may fetch KV from; a request naming
    another is a 400 before anything is held or connected. None: loopback at
    ``disaggregation_bootstrap_port`` only."""
    disaggregation_max_claims_per_peer: int = setting(512, "prefill: most rooms one decode connection may hold claimed and unacknowledged")
    """prefill: most rooms one decode server (one connection) may have claimed and not acknowledged
    at once; claims beyond it are refused (bounds what one peer makes this server hold)."""

    def __post_init__(self) -> None:
        self.disaggregation_mode = _norm(self.disaggregation_mode, null=("null", "none", ""))
        self.disaggregation_transfer_backend = _norm(self.disaggregation_transfer_backend) or "tcp"
        if isinstance(self.disaggregation_prefill_peers, str):
            self.disaggregation_prefill_peers = self.disaggregation_prefill_peers.split(",")

    @property
    def enabled(self) -> bool:
        return self.disaggregation_mode is not None

    def check(self) -> None:
        if not self.enabled:
            return
        from .common.disagg import PrefillPeers, is_loopback  # (lazy: config imports none of the project)
        from .disagg.auth import ENV_KEY, load_key

        _one_of(self.disaggregation_mode, DISAGGREGATION_MODES, "disaggregation_mode", optional=True)
        _one_of(self.disaggregation_transfer_backend, TRANSFER_BACKENDS, "disaggregation_transfer_backend")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValidationError(
                "disaggregation_bootstrap_port must be a port number", param="disaggregation_bootstrap_port"
            )
        _positive(self, "disaggregation_bootstrap_timeout_s", "disaggregation_waiting_timeout_s",
                  "disaggregation_max_claims_per_peer")  # fmt: skip
        if not self.disaggregation_bind_host:
            raise ValidationError(
                "disaggregation_bind_host must be an address", param="disaggregation_bind_host"
            )
        try:
            key = load_key(self.disaggregation_auth_key_file)
        except ValueError as e:
            raise ValidationError(str(e), param="disaggregation_auth_key_file") from None
        peers = PrefillPeers(self.disaggregation_prefill_peers, self.disaggregation_bootstrap_port)
        if key is None:
            # Without a key anyone who reaches a PD socket is trusted: only loopback may go without.
            exposed = None
            if self.disaggregation_mode == "prefill" and not is_loopback(self.disaggregation_bind_host):
                exposed = f"its bootstrap port binds {self.disaggregation_bind_host}"
            elif self.disaggregation_mode == "decode" and not peers.all_loopback:
                exposed = f"it fetches KV from {', '.join(peers.describe())}"
            if exposed is not None:
                raise ValidationError(
                    f"a PD server whose sockets leave loopback needs the PD nodes' shared key ({exposed}): "
                    f"--disaggregation-auth-key-file PATH or {ENV_KEY} (e.g. `openssl rand -hex 32`)",
                    param="disaggregation_auth_key_file",
                )
        if self.disaggregation_transfer_backend == "mooncake":
            from .disagg.mooncake import available

            why = available()
            if why is not None:
                raise ValidationError(
                    f"the mooncake transfer backend is not installed: {why}", param="disaggregation_transfer_backend"
                )


@dataclass
class KernelSettings:
    """How the forward runs: attention backend, int8 batches, torch.compile, where sampling runs,
    CUDA graphs."""

    attention_backend: str = setting("auto", (
        "cpu: kvledger's C++ kernels (paged decode attention in place, fused norm/rotary/SiLU; built "
        "on first use, ~1 min, cached); auto (default): cpu for bfloat16 on a CPU where they build"
    ), choices=ATTENTION_BACKENDS)
    """auto | torch | cpu. cpu: kvledger's C++ kernels (decode attention over the pages in place,
    fused norm/rotary/SiLU); auto picks it for bfloat16 on a CPU where they build, torch otherwise."""
    enable_int8_batch: bool = setting(False, (
        "with a quantization: forwards of 128 rows and more (prefill chunks) in an int8 linear, int8 "
        "activations per token (segments of 64 on kvledger's VNNI kernel, which also takes decode "
        "batches of 16 and more): faster prefills and large batches; less faithful to the file"
    ), kind="switch")
    """In a quantized mode, run large forwards through an int8 linear (weights int8 per output
    channel; ``kernels/quant.Int8Weight``) instead of the file's blocks: on kvledger's VNNI kernel (a
    CPU with AVX512-VNNI and no AMX) forwards of ``linear.INT8_VNNI_ROWS`` (16) rows and more, decode
    batches included, activations int8 per token and per segment of 64 inputs; elsewhere oneDNN's,
    forwards of ``linear.INT8_BATCH_ROWS`` (128) rows and more (prefill chunks; batched decodes stay on
    kvledger's kernel, the faster one below that), activations int8 per token. Faster prefills and
    large batches, but further from the file's weights (bench/quant_agreement.py), so off by default."""
    cpu_amx: str = setting("auto", (
        "on: quantized layers also keep a prepacked bfloat16 copy for calls of 64 rows and more "
        "(prefill chunks), and long prefills' attention runs in torch's SDPA: oneDNN's AMX kernels (2 "
        "bytes a weight more memory); auto (default): on for a quantized bfloat16 model on a CPU with "
        "AMX"
    ), choices=CPU_AMX)
    """auto | on | off. on: quantized layers keep a oneDNN-prepacked bfloat16 copy of their weights
    (the file's own values, dequantized) and run calls of ``linear.AMX_MIN_ROWS`` rows and more (prefill
    chunks, large batches) through it, and the cpu attention backend runs long extends in torch's
    SDPA, both on the AMX tiles oneDNN and torch use where the CPU has them (3-4x the int4 kernel's
    speed at prefill sizes; bench/RESULTS.md). It costs 2 bytes a weight of memory. auto: on for a
    quantized model in bfloat16 on a CPU with AMX; off: kvledger's kernels for every call."""
    enable_torch_compile: bool = setting(False, "compile the forward with torch.compile (faster decode; compiles at start-up)", kind="switch")
    """Run forwards through torch.compile (weights frozen and prepacked for oneDNN, elementwise work
    fused). Faster batched decode; costs tens of seconds of compilation at start (warm-up)."""
    enable_deterministic_inference: bool = setting(False, (
        "batch invariance: a request's tokens and logprobs are the same whatever its batch, "
        "neighbours, chunk size, prefix-cache state or schedule (every call on kernels whose sums "
        "have one order per row; no AMX paths; unseeded sampling draws from --seed and the position)"
    ), kind="switch")
    """SGLang's flag (vLLM: batch invariance): a request's tokens and logprobs do not depend on the batch
    it runs in, its neighbours, the chunk size, the prefix cache or the schedule. Every call takes the
    kernels whose sums have one order per row (docs/architecture.md, "Reduction orders"): the cpu
    attention backend (long extends in its kernels, not SDPA or the AMX flash form), the quantized
    layers on kvledger's VNNI kernel for every row count (``--cpu-amx auto`` is off under it), float
    layers on its dense kernel, windowed/soft-capped/sink attention and MoE experts one row at a time;
    sampled rows without a seed draw from ``(--seed, position)`` like seeded ones. The default
    already keeps a prompt's tokens the same cached or not on a CPU without AMX (the same kernels)."""
    sampling_backend: str = setting("auto", (
        "host: sample from a CPU copy of the logits; device: batched on the logits' device, one copy "
        "of the sampled ids back (same greedy and seeded tokens); auto (default): device on CUDA, "
        "host on CPU"
    ), choices=SAMPLING_BACKENDS)
    """auto | host | device. host: the sampled rows' logits are copied to the CPU and sampled there
    (model/sampler.py); device: batched torch ops where the logits are, one copy of the sampled ids
    back (model/sampler_device.py); both draw the same greedy and seeded tokens. auto: device on CUDA,
    host on a CPU (where both run on the same cores and the host one is as fast)."""
    disable_cuda_graph: bool = setting(False, (
        "on CUDA, run every step eager (by default a step of decodes alone replays the CUDA graph "
        "captured at start for its batch size)"
    ), kind="switch")
    """SGLang's flag. On CUDA a step of decodes alone replays a CUDA graph captured at start for its
    batch-size bucket (engine/graph_runner.py); with this flag every step runs eager. No meaning on
    a CPU (nothing is captured there)."""
    cuda_graph_max_bs: int | None = setting(None, (
        "the largest decode batch captured in a CUDA graph; larger ones run eager (default 160, "
        "capped at --max-running-requests)"
    ))
    """SGLang's flag: the largest decode batch captured; larger batches run eager. None: SGLang's
    default, 160, capped at ``max_running_requests``."""

    def __post_init__(self) -> None:
        self.attention_backend = _norm(self.attention_backend) or "auto"
        self.cpu_amx = _norm(self.cpu_amx) or "auto"
        self.sampling_backend = _norm(self.sampling_backend) or "auto"

    def check(self) -> None:
        _one_of(self.attention_backend, ATTENTION_BACKENDS, "attention_backend")
        _one_of(self.cpu_amx, CPU_AMX, "cpu_amx")
        _one_of(self.sampling_backend, SAMPLING_BACKENDS, "sampling_backend")
        _positive(self, "cuda_graph_max_bs")


@dataclass
class LoraSettings:
    """LoRA adapters of the base model, served side by side in one batch (``model/lora.py``)."""

    enable_lora: bool = setting(False, "serve LoRA adapters (implied by --lora-paths; needed for /load_lora_adapter)", kind="switch")
    lora_paths: list[str] | None = setting(None, "LoRA adapters (peft directories) loaded at start: name=path, or path (name: its basename)", nargs="+", metavar="NAME=PATH")  # noqa: RUF009 (a declaration, not a call at each construction)
    """Adapters loaded at start: ``name=path`` or ``path`` (the name is then the directory's name);
    each a peft adapter directory (adapter_config.json, adapter_model.safetensors)."""
    max_loras_per_batch: int = setting(8, "most distinct adapters among running requests (the base model takes none)")
    """Most distinct adapters among the running requests (the base model takes none of them): a
    request of another adapter waits until one of those ends."""
    max_lora_rank: int = setting(64, "the largest adapter rank accepted (at start and by /load_lora_adapter)")

    def __post_init__(self) -> None:
        if isinstance(self.lora_paths, str):
            self.lora_paths = [self.lora_paths]
        if self.lora_paths:
            self.lora_paths = list(self.lora_paths)
            self.enable_lora = True

    def named_paths(self) -> dict[str, str]:
        """``--lora-paths`` as name -> path (checked: names unique and non-empty)."""
        out: dict[str, str] = {}
        for item in self.lora_paths or []:
            if not isinstance(item, str) or not item.strip():
                raise ValidationError(f"lora_paths entries are name=path or path, got {item!r}", param="lora_paths")
            name, sep, path = item.partition("=")
            if not sep:
                path, name = item, os.path.basename(os.path.normpath(item))
            if not name or not path:
                raise ValidationError(f"lora_paths entry {item!r} needs a name and a path", param="lora_paths")
            if name in out:
                raise ValidationError(f"lora_paths names {name!r} twice", param="lora_paths")
            out[name] = path
        return out

    def check(self) -> None:
        _positive(self, "max_loras_per_batch", "max_lora_rank")
        for name, path in self.named_paths().items():  # what they hold is read (and checked) at start
            if not os.path.isdir(path):
                raise ValidationError(f"lora_paths: {name}={path} is not a directory", param="lora_paths")


@dataclass
class EngineConfig:
    """Settings of the engine core, in sections. ``None`` values mean "derive a sensible value from
    the model and the machine"."""

    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    hicache: HiCacheSettings = field(default_factory=HiCacheSettings)
    hisparse: HiSparseSettings = field(default_factory=HiSparseSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    spec: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    disagg: DisaggregationSettings = field(default_factory=DisaggregationSettings)
    kernels: KernelSettings = field(default_factory=KernelSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)

    SECTIONS: ClassVar[tuple[str, ...]] = (
        "model", "cache", "hicache", "hisparse", "scheduler", "parallel", "spec", "disagg", "kernels", "lora",
    )  # fmt: skip

    # -- the flat view: one name per flag ----------------------------------------------------------------
    @classmethod
    def section_of(cls) -> dict[str, str]:
        """Flat setting name -> the section that holds it."""
        return _SECTION_OF

    @classmethod
    def from_flat(cls, **values: Any) -> EngineConfig:
        """Build from flat names (the CLI's, the offline ``Engine``'s keyword arguments, the engine
        process's payload); an unknown name is a ``TypeError`` naming it."""
        unknown = set(values) - set(_SECTION_OF)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        parts: dict[str, dict] = {s: {} for s in cls.SECTIONS}
        for name, v in values.items():
            parts[_SECTION_OF[name]][name] = v
        return cls(**{s: _SECTION_TYPES[s](**kw) for s, kw in parts.items()})

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name (JSON-ready: what crosses processes and /get_server_info shows)."""
        return {f.name: getattr(getattr(self, s), f.name) for s in self.SECTIONS for f in fields(getattr(self, s))}

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (flat names), normalised like any new value."""
        return EngineConfig.from_flat(**{**self.flat(), **changes})

    # -- checks ------------------------------------------------------------------------------------------
    def check(self) -> str:
        """Every check that needs no model: each section's own, then which features combine
        (``compat.check_combinations``). Returns the device the engine runs on. The CLI runs it before
        starting anything (a bad flag is one line of error, exit 2); the engine runs it again."""
        from .compat import check_combinations
        from .engine.resources import resolve_device

        for s in self.SECTIONS:
            getattr(self, s).check()
        device = resolve_device(self.model.device)
        check_combinations(self, device)
        return device


_SECTION_TYPES = {f.name: f.default_factory for f in fields(EngineConfig)}
_SECTION_OF: dict[str, str] = {}
for _section, _cls in _SECTION_TYPES.items():
    for _f in fields(_cls):
        if _f.name in _SECTION_OF:
            raise TypeError(f"setting {_f.name} is in two sections")
        _SECTION_OF[_f.name] = _section


@dataclass
class ServerConfig:
    """Settings of the HTTP front."""

    host: str = setting("127.0.0.1", "the address the HTTP server binds")
    port: int = setting(30000, "the HTTP port")
    api_key: list[str] | None = setting(  # noqa: RUF009 (a declaration: default None)
        None, (
        "one or more user keys, each its own tenant: 'Authorization: Bearer KEY' (not on /health, "
        "/metrics)"
    ), nargs="+", metavar="KEY")
    admin_api_key: str | None = setting(None, (
        "the operator's key: admin paths (page map, /flush_cache, pause, weights, LoRA), aborting "
        "others' requests"
    ))
    admin_open: bool = setting(False, "without --admin-api-key, let user keys use the admin paths (refused otherwise)", kind="switch")
    allowed_origins: list[str] | None = setting(  # noqa: RUF009 (a declaration: default None)
        None, (
        "web origins (scheme://host[:port]) besides the server's own whose browser requests are "
        "accepted (and granted CORS)"
    ), nargs="+", metavar="ORIGIN")
    tool_call_parser: str = setting("hermes", "the model's tool-call format (hermes = qwen: <tool_call> JSON; llama3; mistral)", choices=TOOL_CALL_PARSERS)
    served_model_name: str | None = setting(None, "the model's name in the API (default: the model file's or directory's)")
    log_level: str = setting("info", "the logging level (debug, info, warning, error)")
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest request body, in bytes (413 past it)")
    body_timeout_s: float = setting(30.0, "seconds a request body may take to arrive whole (408 past it: a stalled client holds nothing)", flags=("--body-timeout",))
    max_n: int = setting(16, "largest n (choices per request)")
    # What one body and one caller may ask of the engine (server/admission.py).
    max_prompts_per_request: int = setting(2048, "prompts (inputs, items, documents) one body may carry (400 past it; OpenAI's embeddings limit)")
    max_choices_per_request: int = setting(1024, "engine requests one body may fan out to, prompts x n (400 past it)")
    max_prompt_tokens_per_request: int = setting(1 << 20, "prompt tokens of one body, all its prompts together (400 past it)")
    max_requests_per_key: int = setting(1024, "engine requests one API key (or anonymous) may have in flight (429 past it)")
    max_stored_responses: int = setting(1024, "responses kept for previous_response_id and GET /v1/responses/{id} (an LRU)")
    pooling: str = setting("last", "/v1/embeddings and /v1/rerank: the last token's final hidden state, or the mean of all", choices=POOLINGS)
    watchdog_timeout_s: float = setting(60.0, "restart the engine if a step makes no progress for this long (seconds)", flags=("--watchdog-timeout",))
    grace_period_s: float = setting(10.0, "time running requests get to finish on SIGTERM/SIGINT (seconds)", flags=("--grace-period",))
    session_journal: str | None = setting(None, "keep open sessions in DIR so that they survive a restart of this server", metavar="DIR")
    """A directory where open sessions' committed tokens are kept, so that they survive the server
    process (re-opened on start, KV recomputed); ``--dp-size`` gives each replica one."""
    engine: EngineConfig = field(default_factory=EngineConfig)

    def check(self) -> None:
        """The keys: none empty, and no user key that is also the admin key (a user key is never one)."""
        keys = self.api_key or []
        if any(not k for k in keys) or self.admin_api_key == "":
            raise ValidationError("an API key must not be empty", param="api_key")
        if self.admin_api_key is not None and self.admin_api_key in keys:
            raise ValidationError("--admin-api-key must differ from every --api-key", param="admin_api_key")



@dataclass
class LaunchSettings:
    """What ``kvledger serve`` starts besides one server: data-parallel replicas behind SGLang's router."""

    dp_size: int = setting(
        1,
        "start this many replicas (ports --port+1..) behind SGLang's router (--port+N+1, its metrics --port+N+2) and a session "
        "front on --port",
        flags=("--dp-size", "--data-parallel-size"),
    )
    router_policy: str = setting(
        "cache_aware", "--dp-size: the router's load-balancing policy", choices=ROUTER_POLICIES
    )


# Where each declared setting is documented: docs/settings.md's table, by section.
SETTINGS_DOC_SECTIONS: tuple[tuple[str, type], ...] = (
    *((s, _SECTION_TYPES[s]) for s in EngineConfig.SECTIONS),
    ("server", ServerConfig),
    ("launch", LaunchSettings),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def settings_markdown() -> str:
    """docs/settings.md's tables: every declared setting by section, with its flag(s), type, default and help."""
    out: list[str] = []
    for section, cls in SETTINGS_DOC_SECTIONS:
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        out += [f"### {section}", "", doc, "", "| flag | type | default | what |", "|---|---|---|---|"]
        for f, flag in declared(cls):
            opts = flag.options(f.name)
            names = " / ".join(f"`{o}`" for o in opts) if flag.kind in (PAIR, TRISTATE) else ", ".join(
                f"`{o}`" for o in opts
            )
            what = flag.help + (f"; {opts[1]}: {flag.help2}" if flag.help2 else "")
            if flag.choices:
                what += f" (one of: {', '.join(str(c) for c in flag.choices)})"
            typ = "bool" if flag.kind in (SWITCH, PAIR) else str(f.type).replace(" | None", "")
            out.append(f"| {names} | {typ} | `{f.default!r}` | {_cell(what)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write_generated(path: str, marker: str, content: str) -> bool:
    """Put ``content`` between a document's ``<!-- MARKER: ... -->`` and ``<!-- /MARKER -->`` lines (the
    generated parts of docs/settings.md and of the README's matrix); True when the file changed."""
    import re

    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = re.sub(
        rf"(<!-- {marker}:[^\n]*-->\n)(.*?)(\n?<!-- /{marker} -->)",
        lambda m: m.group(1) + content.rstrip("\n") + "\n" + m.group(3).lstrip("\n"),
        text,
        flags=re.S,
    )
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


def write_settings_doc(path: str = "docs/settings.md") -> bool:
    """Put ``settings_markdown()`` between docs/settings.md's markers; True when it changed."""
    return write_generated(path, "settings", settings_markdown())


if __name__ == "__main__":  # python -m kvledger.config [--write]: docs/settings.md's tables
    import sys

    if "--write" in sys.argv[1:]:
        print("docs/settings.md: " + ("regenerated" if write_settings_doc() else "current"))
    else:
        print(settings_markdown())
