"""The sections of the step: ``SchedulerSettings`` (batching, chunked prefill, queue order, limits,
sessions, overlap) and ``SpeculativeSettings`` (the drafter)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ValidationError
from .base import (
    CPU_INTERLEAVE_PREFILL_TOKENS,
    CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX,
    CPU_MIXED_STEP_RATIO,
    CPU_OVERLAP_DEFAULT,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    _norm,
    _one_of,
    _positive,
    setting,
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
    step, before the next decode step: SGLang's order). None: on the CPU ``CPU_INTERLEAVE_PREFILL_TOKENS``
    with AMX tiles (512), ``..._NO_AMX`` without (128): a prefill step of ~0.1-0.15 s on either, 0 on CUDA. With mixed chunks it caps a mixed step's prefill part. Measured on the CPU, 32
    streams of 128+128 tokens: TTFT p50 halved (0.56-0.60 s -> 0.31-0.34 s) for 3-8% fewer tokens
    per second (bench/RESULTS.md)."""
    mixed_step_ratio: float | None = setting(None, (
        "while requests decode, prompt chunks join their decode step with as many tokens as keep the "
        "step's measured cost within this many of their decode steps (at most "
        "--interleave-prefill-tokens); 0: off, the default (2.5 cut ITL p99 on the CPU at a cost in "
        "throughput and TTFT: bench/RESULTS.md)"
    ))
    """Pacing (``scheduler/pacing.py``): while requests decode and interleaving is on
    (``interleave_prefill_tokens`` > 0), a step is mixed (the decodes and a prompt chunk in one
    forward, mixed chunks or not) and its prompt tokens are as many as keep its predicted cost within
    this many decode steps of the batch being formed (running and waiting requests, up to
    ``max_running_requests``), from the step costs the engine measures; at most
    ``interleave_prefill_tokens``. Bounds the running streams' inter-token latency p99 to about this
    many times their p50 (issue 54's target: 3). None: ``CPU_MIXED_STEP_RATIO`` (off) on the CPU, 0 on CUDA.
    0: the budget is ``interleave_prefill_tokens`` alone, as before. Otherwise more than 1."""
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

    def interleave_tokens(self, device: str, amx: bool) -> int:
        """``interleave_prefill_tokens`` on ``device`` (0: prefill first); unset, 0 on CUDA and on the
        CPU the budget of a CPU with AMX tiles or without (``amx``: the caller asks the hardware,
        ``model.linear.amx_available``)."""
        if self.interleave_prefill_tokens is None:
            if device.startswith("cuda"):
                return 0
            return CPU_INTERLEAVE_PREFILL_TOKENS if amx else CPU_INTERLEAVE_PREFILL_TOKENS_NO_AMX
        return self.interleave_prefill_tokens

    def step_ratio(self, device: str) -> float:
        """``mixed_step_ratio`` on ``device`` (0: no pacing); unset, 0 on CUDA and
        ``CPU_MIXED_STEP_RATIO`` on the CPU."""
        if self.mixed_step_ratio is None:
            return 0.0 if device.startswith("cuda") else CPU_MIXED_STEP_RATIO
        return float(self.mixed_step_ratio)

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
        r = self.mixed_step_ratio
        if r is not None and not (r == 0 or (math.isfinite(r) and r > 1)):
            raise ValidationError("mixed_step_ratio must be 0 (off) or a number above 1", param="mixed_step_ratio")
        if self.request_timeout_s is not None and not math.isfinite(self.request_timeout_s):
            raise ValidationError("request_timeout_s must be a finite number of seconds", param="request_timeout_s")
        _positive(self, "max_sessions", "max_stop_strings", "max_stop_string_len", "max_top_logprobs", allow_zero=True)
        _positive(self, "max_grammar_len", "max_grammar_depth", "grammar_compile_timeout_s")
        if not math.isfinite(self.grammar_compile_timeout_s):
            raise ValidationError(
                "grammar_compile_timeout_s must be a finite number of seconds", param="grammar_compile_timeout_s"
            )


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
        # That the draft model exists is the disk's question: spec/setup.py's check_draft_model, run
        # by the composition root (launch/validate.py) after this one.
