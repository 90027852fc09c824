"""Command line: ``kvledger generate`` (offline), ``kvledger serve`` (HTTP server)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from .common.pooling import POOLING_METHODS
from .config import (
    ATTENTION_BACKENDS,
    CPU_AMX,
    CPU_INTERLEAVE_PREFILL_TOKENS,
    CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX,
    DISAGGREGATION_MODES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    SAMPLING_BACKENDS,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    STORAGE_BACKENDS,
    TRANSFER_BACKENDS,
    WRITE_POLICIES,
    EngineConfig,
    ServerConfig,
)
from .errors import KVLedgerError, ValidationError
from .server.tools import PARSERS


def _bool_pair(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    dest = name.replace("-", "_")
    g = p.add_mutually_exclusive_group()
    g.add_argument(f"--{name}", dest=dest, action="store_true", help=help)
    g.add_argument(f"--disable-{name.removeprefix('enable-')}", dest=dest, action="store_false")
    p.set_defaults(**{dest: default})


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig setting, SGLang's names (--page-size, --max-total-tokens, ...); the
    defaults are the settings' own."""
    d = argparse.Namespace(**EngineConfig().flat())
    p.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=None,
        help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--device", default=d.device,
                   help="cpu (default) | cuda | cuda:N | auto (a CUDA device where torch sees one, else cpu)")  # fmt: skip
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    p.add_argument(
        "--quantization",
        default=d.quantization or "none",
        choices=QUANTIZATIONS,
        help="weight-only int8 / int4 linear layers in GGUF's blocks of 32 (Q8_0 / Q4_1-exact; CPU only, "
        "needs bfloat16). auto (default): a quantized GGUF in its own precision (Q4 -> int4, Q5-Q8 -> "
        "int8) when the dtype is bfloat16",
    )
    p.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=ATTENTION_BACKENDS,
        help="cpu: kvledger's C++ kernels (paged decode attention in place, fused norm/rotary/SiLU; built "
        "on first use, ~1 min, cached); auto (default): cpu for bfloat16 on a CPU where they build",
    )
    p.add_argument(
        "--sampling-backend",
        default=d.sampling_backend,
        choices=SAMPLING_BACKENDS,
        help="host: sample from a CPU copy of the logits; device: batched on the logits' device, one copy "
        "of the sampled ids back (same greedy and seeded tokens); auto (default): device on CUDA, host on CPU",
    )
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="on CUDA, run every step eager (by default a step of decodes alone replays the CUDA "
                   "graph captured at start for its batch size)")  # fmt: skip
    p.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs,
                   help="the largest decode batch captured in a CUDA graph; larger ones run eager "
                   "(default 160, capped at --max-running-requests)")  # fmt: skip
    p.add_argument(
        "--enable-int8-batch",
        action="store_true",
        help="with a quantization: forwards of 128 rows and more (prefill chunks) in an int8 linear, "
        "int8 activations per token (segments of 64 on kvledger's VNNI kernel, which also takes decode "
        "batches of 16 and more): faster prefills and large batches; less faithful to the file",
    )
    p.add_argument(
        "--cpu-amx",
        default=d.cpu_amx,
        choices=CPU_AMX,
        help="on: quantized layers also keep a prepacked bfloat16 copy for calls of 64 rows and more "
        "(prefill chunks), and long prefills' attention runs in torch's SDPA: oneDNN's AMX kernels "
        "(2 bytes a weight more memory); auto (default): on for a quantized bfloat16 model on a CPU with AMX",
    )
    p.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="compile the forward with torch.compile (faster decode; compiles at start-up)",
    )
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch invariance: a request's tokens and logprobs are the same whatever its batch, neighbours, "
        "chunk size, prefix-cache state or schedule (every call on kernels whose sums have one order per row; "
        "no AMX paths; unseeded sampling draws from --seed and the position)",
    )
    p.add_argument("--page-size", type=int, default=d.page_size,
                   help=f"tokens per KV page (default {d.page_size}; at least 8 with --enable-hisparse)")  # fmt: skip
    p.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens)
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, type=str.lower, choices=(*KV_CACHE_DTYPES, "fp8"),
                   help="the KV pool's element type: auto (the model's) or fp8_e4m3 (alias fp8: half the bytes, "
                   "twice the tokens; attention widens it; on the CPU)")  # fmt: skip
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--reasoning-parser", default=d.reasoning_parser, choices=REASONING_PARSERS,
                   help="the model's reasoning markers (<think>...</think>): chat answers give them as "
                   "reasoning_content, and a request's grammar starts after </think>")  # fmt: skip
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    p.add_argument("--interleave-prefill-tokens", type=int, default=d.interleave_prefill_tokens,
                   help="while requests decode, the most prompt tokens a step brings, then a decode step "
                   "runs (first tokens sooner under bursts); 0: prefill first (default: "
                   f"{CPU_INTERLEAVE_PREFILL_TOKENS} on a CPU with AMX, {CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX} "
                   "on other CPUs, 0 on CUDA)")  # fmt: skip
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests)
    p.add_argument("--max-queued-prefill-tokens", type=int, default=d.max_queued_prefill_tokens,
                   help="most prompt tokens waiting for admission; an arrival past it gets a 429 (default: no budget)")  # fmt: skip
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                   help="seconds a request may take, queued and running; past it it ends with a 503 (default: off)")  # fmt: skip
    _bool_pair(
        p,
        "enable-mixed-chunk",
        d.enable_mixed_chunk,
        "prefill chunks and decodes in one forward: first tokens sooner under bursts, running streams wait for the chunk",
    )
    _bool_pair(p, "enable-prefix-cache", d.enable_prefix_cache, "radix prefix cache")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--disable-overlap-schedule", dest="disable_overlap_schedule", action="store_const", const=True,
                   default=d.disable_overlap_schedule,
                   help="schedule each step after the previous one's result (default: overlapped on CUDA; "
                   "on the CPU as measured, see README)")  # fmt: skip
    g.add_argument("--enable-overlap-schedule", dest="disable_overlap_schedule", action="store_const", const=False,
                   help="prepare step N+1 while step N runs, on the CPU too")  # fmt: skip
    p.add_argument("--schedule-policy", default=d.schedule_policy, type=str.lower, choices=SCHEDULE_POLICIES,
                   help="order of the waiting queue: fcfs (arrival), lpm (longest prefix-cache match first), "
                   "dfs-weight (radix subtrees with most waiting requests first)")  # fmt: skip
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   help="order waiting requests by their priority (larger is more important) and let one "
                   "preempt lower-priority running requests when the pool or slots are full")  # fmt: skip
    p.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with --enable-priority-scheduling: smaller priority values are more important")  # fmt: skip
    p.add_argument("--priority-scheduling-preemption-threshold", type=int,
                   default=d.priority_scheduling_preemption_threshold,
                   help="preempt a running request only for a priority higher by more than this (default 10)")  # fmt: skip
    p.add_argument("--abort-on-priority-when-disabled", action="store_true",
                   help="without --enable-priority-scheduling, refuse (503) a request that sends a priority "
                   "instead of ignoring it")  # fmt: skip
    p.add_argument("--strict-memory", action="store_true", help="raise on any memory-ledger violation")
    p.add_argument("--audit-interval-s", type=float, default=d.audit_interval_s,
                   help="a full ledger audit at least this often while busy (0: only when idle)")  # fmt: skip
    p.add_argument("--max-sessions", type=int, default=d.max_sessions, help="most open streaming sessions")
    p.add_argument(
        "--session-timeout-s",
        type=float,
        default=d.session_timeout_s,
        help="idle sessions are closed after this many seconds",
    )
    p.add_argument("--speculative-algorithm", default=d.speculative_algorithm, type=str.upper,
                   choices=SPECULATIVE_ALGORITHMS,
                   help="speculative decoding: NGRAM (the request's own text) or STANDALONE (a draft model)")  # fmt: skip
    p.add_argument("--speculative-draft-model-path", default=d.speculative_draft_model_path)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=d.speculative_num_draft_tokens)
    for side in ("min", "max"):
        dest = f"speculative_ngram_{side}_match_window_size"
        p.add_argument(f"--speculative-ngram-{side}-match-window-size", f"--speculative-ngram-{side}-match-window",
                       dest=dest, type=int, default=getattr(d, dest))  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--num-threads", type=int, default=d.num_threads)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=d.tp_size,
                   help="tensor parallel ranks (processes over torch.distributed)")  # fmt: skip
    p.add_argument("--nnodes", type=int, default=d.nnodes, help="machines the TP ranks span")
    p.add_argument("--node-rank", type=int, default=d.node_rank, help="this machine's index (0 serves HTTP)")
    p.add_argument("--dist-init-addr", default=d.dist_init_addr,
                   help="host:port of node 0's rendezvous (node 0 listens on that address only)")  # fmt: skip
    p.add_argument("--dist-auth-key-file", default=d.dist_auth_key_file,
                   help="the key every TP rank proves before the group forms (same file on every node; "
                   "or KVLEDGER_DIST_AUTH_KEY); needed with --nnodes > 1")  # fmt: skip
    p.add_argument("--dist-timeout", dest="dist_timeout_s", type=float, default=d.dist_timeout_s,
                   help="seconds a collective may wait (idle ranks wait in one for the next step)")  # fmt: skip
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help="most stop strings a request may give")  # fmt: skip
    p.add_argument("--max-stop-string-len", type=int, default=d.max_stop_string_len,
                   help="longest stop string, in characters")  # fmt: skip
    p.add_argument("--max-top-logprobs", type=int, default=d.max_top_logprobs,
                   help="most alternatives a request may ask per token (top_logprobs)")  # fmt: skip
    p.add_argument("--max-grammar-len", type=int, default=d.max_grammar_len,
                   help="longest grammar a request may give (json_schema, regex, ebnf), in characters")  # fmt: skip
    p.add_argument("--max-grammar-depth", type=int, default=d.max_grammar_depth,
                   help="deepest nesting of a grammar (a schema's objects and arrays, a regex's or EBNF's groups)")  # fmt: skip
    p.add_argument("--grammar-compile-timeout-s", type=float, default=d.grammar_compile_timeout_s,
                   help="seconds a grammar may take to compile (off the engine's thread); past it a 400")  # fmt: skip
    p.add_argument("--disaggregation-mode", default=None, choices=["null", *DISAGGREGATION_MODES],
                   help="this server's part behind sglang-router --pd-disaggregation (default: null, neither)")  # fmt: skip
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=d.disaggregation_bootstrap_port,
                   help="prefill: where decode servers fetch KV; decode: the port assumed if the router gives none")  # fmt: skip
    p.add_argument("--disaggregation-bind-host", default=d.disaggregation_bind_host,
                   help="prefill: the address the bootstrap port binds (default: 127.0.0.1; another "
                   "needs --disaggregation-auth-key-file); mooncake: the address its engine announces")  # fmt: skip
    p.add_argument("--disaggregation-auth-key-file", default=d.disaggregation_auth_key_file, metavar="PATH",
                   help="the key the PD nodes share (the same file on every prefill and decode server, at least "
                   "32 bytes): every PD message is sealed with an HMAC under it (default: $KVLEDGER_DISAGGREGATION_"
                   "AUTH_KEY, else none: loopback only)")  # fmt: skip
    p.add_argument("--disaggregation-prefill-peers", nargs="+", default=d.disaggregation_prefill_peers,
                   metavar="HOST:PORT",
                   help="decode: the prefill bootstrap addresses it may fetch KV from, as the router names them; "
                   "another is a 400 (default: 127.0.0.1 / localhost at --disaggregation-bootstrap-port)")  # fmt: skip
    p.add_argument("--disaggregation-max-claims-per-peer", type=int, default=d.disaggregation_max_claims_per_peer,
                   help="prefill: most rooms one decode connection may hold claimed and unacknowledged")  # fmt: skip
    p.add_argument("--disaggregation-transfer-backend", default=d.disaggregation_transfer_backend,
                   choices=TRANSFER_BACKENDS,
                   help="tcp: the built-in KV transport (ZMQ over TCP); mooncake: Mooncake's transfer engine (TCP)")  # fmt: skip
    for flag, dest, what in (
        ("--disaggregation-bootstrap-timeout", "disaggregation_bootstrap_timeout_s",
         "prefill: release a request's KV if no decode server claims and acknowledges it in this long"),
        ("--disaggregation-waiting-timeout", "disaggregation_waiting_timeout_s",
         "decode: fail (502) and release a request whose KV has not arrived in this long"),
    ):  # fmt: skip
        p.add_argument(flag, dest=dest, type=float, default=getattr(d, dest), help=f"{what} (seconds)")
    p.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="back the prefix cache with host memory (L2) and, with a storage backend, files (L3)")  # fmt: skip
    p.add_argument("--hicache-ratio", type=float, default=d.hicache_ratio,
                   help="L2 size as a multiple of the KV pool (when --hicache-size is 0)")  # fmt: skip
    p.add_argument(
        "--hicache-size", type=float, default=d.hicache_size, help="L2 size in GB (0: use the ratio)"
    )
    p.add_argument("--hicache-write-policy", default=d.hicache_write_policy,
                   choices=WRITE_POLICIES,
                   help="when a prefix is copied to L2: when cached, on its second hit, or when evicted")  # fmt: skip
    p.add_argument("--hicache-storage-backend", default=d.hicache_storage_backend, choices=STORAGE_BACKENDS,
                   help="an L3 tier: one file per KV page under --hicache-storage-dir (survives restarts)")  # fmt: skip
    p.add_argument(
        "--hicache-storage-dir", default=d.hicache_storage_dir, help="where L3 files live (made 0700)"
    )
    p.add_argument("--hicache-salt", default=d.hicache_salt,
                   help="per-deployment salt of the page keys (default: a random one kept in the storage dir)")  # fmt: skip
    p.add_argument("--hicache-load-back-threshold", type=int, default=d.hicache_load_back_threshold,
                   help="L2 matches shorter than this many tokens are recomputed")  # fmt: skip
    p.add_argument("--hicache-prefetch-threshold", type=int, default=d.hicache_prefetch_threshold,
                   help="L3 hits shorter than this many tokens are not prefetched")  # fmt: skip
    p.add_argument("--hicache-prefetch-timeout", dest="hicache_prefetch_timeout_s", type=float,
                   default=d.hicache_prefetch_timeout_s,
                   help="seconds a queued request waits for its L3 prefetch")  # fmt: skip
    p.add_argument("--enable-hisparse", action="store_true",
                   help="sparse decode attention for long prompts: the whole KV in a host pool, the pages "
                   "each step reads (Quest's choice) in a per-request hot budget")  # fmt: skip
    p.add_argument("--hisparse-top-k-pages", type=int, default=d.hisparse_top_k_pages,
                   help="pages each layer and KV head reads besides the sink and recent ones")  # fmt: skip
    p.add_argument("--hisparse-hot-pages", type=int, default=d.hisparse_hot_pages,
                   help="KV-pool pages per sparse request (at least sink + recent + top-k)")  # fmt: skip
    p.add_argument("--hisparse-min-context", type=int, default=d.hisparse_min_context,
                   help="prompts shorter than this attend densely")  # fmt: skip
    p.add_argument("--hisparse-sink-pages", type=int, default=d.hisparse_sink_pages,
                   help="the first pages every step reads")  # fmt: skip
    p.add_argument("--hisparse-recent-pages", type=int, default=d.hisparse_recent_pages,
                   help="the last pages every step reads (the one being written included)")  # fmt: skip
    p.add_argument("--hisparse-host-ratio", type=float, default=d.hisparse_host_ratio,
                   help="the HiSparse host pool's size as a multiple of the KV pool")  # fmt: skip
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (implied by --lora-paths; needed for /load_lora_adapter)")  # fmt: skip
    p.add_argument("--lora-paths", nargs="+", default=d.lora_paths, metavar="NAME=PATH",
                   help="LoRA adapters (peft directories) loaded at start: name=path, or path (name: its basename)")  # fmt: skip
    p.add_argument("--max-loras-per-batch", type=int, default=d.max_loras_per_batch,
                   help="most distinct adapters among running requests (the base model takes none)")  # fmt: skip
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="the largest adapter rank accepted")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings from the flags, checked before anything starts (a bad one: exit 2)."""
    names = EngineConfig.section_of()
    values = {k: v for k, v in vars(args).items() if k in names}
    cfg = EngineConfig.from_flat(**values)
    cfg.check()
    return cfg


def _generate(args: argparse.Namespace) -> int:
    from .launch import Engine

    cfg = engine_config(args)
    eng = Engine(**cfg.flat())
    prompt = args.prompt
    if eng.tokenizer is not None and getattr(eng.tokenizer, "chat_template", None) and not args.raw:
        prompt = eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    shown = ""
    for chunk in eng.generate(prompt, sp, stream=True):
        sys.stdout.write(chunk["text"][len(shown) :])
        sys.stdout.flush()
        shown = chunk["text"]
    meta = chunk["meta_info"]
    print(f"\n[{meta['completion_tokens']} tokens, finish: {meta['finish_reason']['type']}]", file=sys.stderr)
    eng.shutdown()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .server.run import serve

    engine = engine_config(args)
    if args.dp_size > 1:
        return _serve_dp(args, engine)
    if engine.parallel.node_rank > 0:  # another machine of a multi-node group: its TP ranks, no HTTP
        from .parallel.node import run_node

        return run_node(engine)
    names = {f.name for f in dataclasses.fields(ServerConfig)} - {"engine"}
    return serve(ServerConfig(**{k: v for k, v in vars(args).items() if k in names}, engine=engine))


def _serve_dp(args: argparse.Namespace, engine: EngineConfig) -> int:
    """``--dp-size N``: N replicas of this command behind SGLang's router (server/dp_launcher.py)."""
    from .server.dp_launcher import serve_dp

    if engine.disagg.enabled or engine.parallel.nnodes > 1:
        raise ValidationError(
            "--dp-size starts regular replicas on this machine (no PD, one node)", param="dp_size"
        )
    raw = args.raw_argv[args.raw_argv.index("serve") + 1 :]
    return serve_dp(
        raw,
        args.host,
        args.port,
        args.dp_size,
        args.router_policy,
        args.num_threads,
        args.api_key,
        args.grace_period_s,
        args.session_journal,
        args.max_body_bytes,
        engine.flat()["max_sessions"],
        args.body_timeout_s,
        args.allowed_origins,
    )


def add_server_args(p: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field; defaults are the dataclass's."""
    d = ServerConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--api-key",
        nargs="+",
        metavar="KEY",
        default=d.api_key,
        help="one or more user keys, each its own tenant: 'Authorization: Bearer KEY' (not on /health, /metrics)",
    )
    p.add_argument(
        "--admin-api-key",
        default=d.admin_api_key,
        help="the operator's key: admin paths (page map, /flush_cache, pause, weights, LoRA), aborting others' requests",
    )
    p.add_argument("--admin-open", action="store_true", default=d.admin_open,
                   help="without --admin-api-key, let user keys use the admin paths (refused otherwise)")  # fmt: skip
    p.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN", default=d.allowed_origins,
                   help="web origins (scheme://host[:port]) besides the server's own whose browser requests are accepted")  # fmt: skip
    p.add_argument(
        "--tool-call-parser",
        default=d.tool_call_parser,
        choices=sorted(PARSERS),
        help="the model's tool-call format (hermes = qwen: <tool_call> JSON; llama3; mistral)",
    )
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--body-timeout", dest="body_timeout_s", type=float, default=d.body_timeout_s,
                   help="seconds a request body may take to arrive whole (408 past it)")  # fmt: skip
    p.add_argument("--max-n", type=int, default=d.max_n, help="largest n (choices per request)")
    p.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                   help="prompts (inputs, items, documents) one body may carry (400 past it)")  # fmt: skip
    p.add_argument("--max-choices-per-request", type=int, default=d.max_choices_per_request,
                   help="engine requests one body may fan out to, prompts x n (400 past it)")  # fmt: skip
    p.add_argument("--max-prompt-tokens-per-request", type=int, default=d.max_prompt_tokens_per_request,
                   help="prompt tokens of one body, all its prompts together (400 past it)")  # fmt: skip
    p.add_argument("--max-requests-per-key", type=int, default=d.max_requests_per_key,
                   help="engine requests one API key (or anonymous) may have in flight (429 past it)")  # fmt: skip
    p.add_argument("--max-stored-responses", type=int, default=d.max_stored_responses,
                   help="responses kept for previous_response_id and GET /v1/responses/{id} (an LRU)")  # fmt: skip
    p.add_argument("--pooling", default=d.pooling, choices=list(POOLING_METHODS),
                   help="/v1/embeddings and /v1/rerank: the last token's final hidden state, or the mean of all")  # fmt: skip
    p.add_argument("--session-journal", default=d.session_journal, metavar="DIR",
                   help="keep open sessions in DIR so that they survive a restart of this server")  # fmt: skip
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1,
                   help="start this many replicas (ports --port+1..) behind SGLang's router (--port+N+1) and a session front on --port")  # fmt: skip
    p.add_argument("--router-policy", default="cache_aware",
                   choices=["cache_aware", "round_robin", "random", "power_of_two", "manual"],
                   help="--dp-size: the router's load-balancing policy")  # fmt: skip
    for flag, dest, what in (
        (
            "--watchdog-timeout",
            "watchdog_timeout_s",
            "restart the engine if a step makes no progress for this long",
        ),
        ("--grace-period", "grace_period_s", "time running requests get to finish on SIGTERM/SIGINT"),
    ):
        p.add_argument(flag, dest=dest, type=float, default=getattr(d, dest), help=f"{what} (seconds)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvledger", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion offline (no server)")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--log-level", default="warning")
    add_engine_args(g)
    g.set_defaults(func=_generate)
    b = sub.add_parser("bench", help="benchmark any OpenAI-compatible server (JSON report, PNG plot)")
    from .bench import add_bench_args, cli_main

    add_bench_args(b)
    b.set_defaults(func=cli_main)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible and SGLang-compatible HTTP API")
    add_server_args(s)
    add_engine_args(s)
    s.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except KVLedgerError as e:
        print(f"kvledger: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
