"""One dataclass tree for every setting. CLI flags map 1:1 onto these fields (SGLang's names)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class EngineConfig:
    """Settings of the engine core: model, memory pools, scheduler.

    ``None`` means "derive a sensible value from the model and the machine" (see ``resolve``).
    """

    model: str | None = None
    """Path to a GGUF file or a Hugging Face model directory; None = the default SmolLM2 model."""
    device: str = "cpu"
    """cpu | cuda | cuda:N | auto (the first CUDA device where torch sees one, else the CPU). On CUDA
    the model runs in torch (SDPA attention, bf16 GEMMs; weights served unquantized) and sampling
    stays on the host; tensor parallelism and disaggregation are CPU-only so far. The default stays
    cpu until the CUDA path has run on a GPU (tests/engine/test_device.py): a GPU is opt-in."""
    dtype: str = "auto"
    """auto | float32 | bfloat16. auto picks the faster one on this machine."""
    quantization: str | None = "auto"
    """auto | none | int8 | int4. Weight-only quantized linear layers in GGUF's blocks of 32 (int4 =
    Q4_1: a Q4_1 file's own weights; int8 = Q8_0; the LM head stays int8), CPU only, needs bfloat16.
    Where kvledger's CPU kernels load they serve every forward (int8 activations per block of 32,
    llama.cpp's scheme; faster than the bf16 GEMM at every batch size here); otherwise torch's
    weight-only kernels serve forwards of at most 4 rows and the bf16 GEMM the rest.
    auto: the checkpoint's own precision where the dtype is bfloat16 (a Q4 GGUF -> int4, Q5/Q6/Q8 ->
    int8, float checkpoints none); none with float32. Output within the tolerance in
    docs/architecture.md, not token-exact. None = none."""
    attention_backend: str = "auto"
    """auto | torch | cpu. cpu: kvledger's C++ kernels (decode attention over the pages in place,
    fused norm/rotary/SiLU); auto picks it for bfloat16 on a CPU where they build, torch otherwise."""
    enable_int8_batch: bool = False
    """In a quantized mode, run forwards of 128 rows and more (prefill chunks) through oneDNN's int8
    linear (weights int8 per output channel, activations int8 per token) instead: faster for long
    prefills, but further from the file's weights (bench/quant_agreement.py), so off by default.
    Batched decodes stay on kvledger's kernel, the faster one below ~100 rows."""
    enable_torch_compile: bool = False
    """Run forwards through torch.compile (weights frozen and prepacked for oneDNN, elementwise work
    fused). Faster batched decode; costs tens of seconds of compilation at start (warm-up)."""
    page_size: int = 1
    """Tokens per KV page (1 and 16 are both tested)."""
    max_total_tokens: int | None = None
    """KV capacity in tokens (rounded down to whole pages). None: sized from the model (see resolve)."""
    context_length: int | None = None
    """Longest sequence (prompt + output). None: the model's own limit."""
    chunked_prefill_size: int = 512
    """Most prompt tokens one forward pass takes (all requests together); longer prompts are chunked."""
    max_running_requests: int = 64
    """Most requests decoding at once; also the number of request slots."""
    max_queued_requests: int = 256
    """Most requests waiting for admission; past it new requests are refused (429)."""
    enable_mixed_chunk: bool = False
    """Run a prefill chunk and the running decodes in one forward pass. Off by default, as in SGLang:
    on a burst of new requests it halves TTFT p50 but multiplies the running requests' ITL p99 by ~6
    and costs ~4% throughput (bench/mixed_chunk.py, bench/RESULTS.md)."""
    enable_prefix_cache: bool = True
    """Keep finished requests' KV in the radix tree for reuse by later requests."""
    strict_memory: bool = False
    """Raise on any ledger violation (tests, CI). Production mode logs, counts, reclaims, serves on."""
    audit_interval_s: float = 10.0
    """A full audit at a safe point at least this often while the engine is busy (0: only when it
    goes idle); an engine that goes idle is audited then, every time."""
    max_sessions: int = 64
    """Most open streaming sessions; opening another is refused (429)."""
    session_timeout_s: float | None = 600.0
    """Idle sessions are closed after this many seconds (a session's own timeout wins)."""
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_top_logprobs: int = 20
    speculative_algorithm: str | None = None
    """None | NGRAM | STANDALONE. NGRAM drafts from the request's own prompt and output
    (spec/ngram.py), STANDALONE with a small draft model (spec/draft_model.py); the drafts are verified
    in the same forward as everything else, output distribution unchanged."""
    speculative_draft_model_path: str | None = None
    """STANDALONE: the draft model (GGUF or HF directory) of the same tokenizer."""
    speculative_num_draft_tokens: int = 4
    """Most drafts one request verifies per step."""
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    """NGRAM: the suffix that must have occurred before, in tokens (longest first)."""
    seed: int = 0
    """Seed of the engine's generator for requests that bring no seed of their own."""
    num_threads: int | None = None
    """torch intra-op threads; None leaves torch's default."""
    tp_size: int = 1
    """Tensor parallel ranks (processes, over torch.distributed: gloo on CPUs)."""
    nnodes: int = 1
    """Machines the TP ranks span (tp_size / nnodes ranks on each); node 0 serves HTTP."""
    node_rank: int = 0
    dist_init_addr: str | None = None
    """host:port of rank 0's rendezvous (multi-node); None picks a free port on 127.0.0.1."""
    dist_timeout_s: float = 24 * 3600.0
    """How long a collective may wait. Idle workers wait in one for the next step, so this is long; a
    rank that dies breaks its connections at once, and a hung one is the front's watchdog's to catch."""

    disaggregation_mode: str | None = None
    """None | prefill | decode: this server's part in prefill/decode disaggregation behind SGLang's
    router (``disagg/``). Requests without a bootstrap room are served whole either way."""
    disaggregation_bootstrap_port: int = 8998
    """prefill: the port decode servers fetch KV from; decode: the port assumed when the router
    passes none."""
    disaggregation_bind_host: str | None = None
    """prefill: the address the bootstrap port binds (None: the HTTP server's --host)."""
    disaggregation_transfer_backend: str = "tcp"
    """tcp: the built-in transport (ZMQ over TCP, ``disagg/wire.py``)."""
    disaggregation_bootstrap_timeout_s: float = 300.0
    """prefill: how long a finished request's KV waits for its decode server to claim and
    acknowledge it before it is released."""
    disaggregation_waiting_timeout_s: float = 300.0
    """decode: how long an admitted request waits for its KV before it fails (502) and is released."""

    enable_hierarchical_cache: bool = False
    """Back the radix cache with a host-memory tier (L2) and optionally files (L3): a prefix evicted
    from the KV pool is loaded back instead of recomputed (``hicache/``, SGLang's HiCache)."""
    hicache_ratio: float = 2.0
    """L2 size as a multiple of the KV pool (used when hicache_size is 0)."""
    hicache_size: float = 0.0
    """L2 size in GB (0: use hicache_ratio)."""
    hicache_write_policy: str = "write_through"
    """write_through: copy a prefix to L2 when it is cached; write_through_selective: on its second
    hit; write_back: when it is evicted from the KV pool."""
    hicache_storage_backend: str | None = None
    """None | file: an L3 tier of one file per page under hicache_storage_dir (survives restarts)."""
    hicache_storage_dir: str | None = None
    hicache_salt: str | None = None
    """Salt of the page-key chain (per deployment). None: a random one kept in the storage dir."""
    hicache_load_back_threshold: int = 16
    """L2 matches shorter than this many tokens are recomputed rather than loaded."""
    hicache_prefetch_threshold: int = 64
    """An L3 hit shorter than this many tokens is not prefetched."""
    hicache_prefetch_timeout_s: float = 2.0
    """How long a queued request waits for its L3 prefetch before it is computed without it."""

    def replace(self, **changes) -> EngineConfig:
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return EngineConfig(**values)


@dataclass
class ServerConfig:
    """Settings of the HTTP front."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None
    tool_call_parser: str = "hermes"
    """How tool calls are written and parsed: hermes (= qwen), llama3 or mistral."""
    """Guards the page map, the dashboard, /flush_cache and aborting other callers' requests."""
    served_model_name: str | None = None
    log_level: str = "info"
    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    watchdog_timeout_s: float = 60.0
    """An engine step that makes no progress for this long is killed and the engine restarted."""
    grace_period_s: float = 10.0
    """On SIGTERM/SIGINT running requests get this long to finish before they are aborted."""
    engine: EngineConfig = field(default_factory=EngineConfig)
