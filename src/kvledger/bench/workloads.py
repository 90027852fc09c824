"""Benchmark workloads: lists of prompts with target input and output lengths, all from a seed.

Prompts are random token ids of the benchmark's tokenizer decoded to text (as SGLang's and vLLM's
serving benchmarks do), so any OpenAI-compatible server can be driven with the same workload. Text
re-tokenizes to about the asked length; the report uses the server's own counts where it gives them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

WORKLOADS = ("random", "sharegpt", "shared-prefix")


@dataclass
class BenchRequest:
    """One request of a workload: a completion prompt and the number of tokens to generate."""

    prompt: str
    input_len: int  # tokens of the prompt under the benchmark's tokenizer
    output_len: int


@dataclass
class WorkloadSpec:
    """What to generate. Lengths are in tokens."""

    kind: str = "random"
    num_prompts: int = 32
    seed: int = 0
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 1.0
    """random: lengths are drawn uniformly from [len * range_ratio, len] (1.0: fixed lengths)."""
    max_input_len: int = 1024
    max_output_len: int = 512
    """sharegpt: lengths are clipped to these."""
    prefix_len: int = 512
    """shared-prefix: tokens of the one system prompt every question shares."""
    question_len: int = 32


class _TextMaker:
    """Turns a target token count into text via random ids of ordinary (non-special) tokens."""

    def __init__(self, tokenizer: Any, rng: random.Random):
        self.tok = tokenizer
        self.rng = rng
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = len(tokenizer)
        # Skip the low ids (bytes, control tokens in most vocabularies) and the special ones.
        lo = min(100, vocab // 4)
        self.ids = [i for i in range(lo, vocab) if i not in special]

    def ids_of(self, n: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(max(1, n))]

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))


def _lognormal_len(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma))))))


def make_workload(spec: WorkloadSpec, tokenizer: Any) -> list[BenchRequest]:
    """Build ``spec.num_prompts`` requests; the same spec and tokenizer always give the same list."""
    if spec.kind not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.kind!r}; choose from {', '.join(WORKLOADS)}")
    if spec.num_prompts < 1:
        raise ValueError("num_prompts must be >= 1")
    rng = random.Random(spec.seed)
    maker = _TextMaker(tokenizer, rng)
    out: list[BenchRequest] = []
    if spec.kind == "random":
        r = min(max(spec.range_ratio, 0.0), 1.0)
        for _ in range(spec.num_prompts):
            n_in = rng.randint(max(1, int(spec.input_len * r)), spec.input_len)
            n_out = rng.randint(max(1, int(spec.output_len * r)), spec.output_len)
            text = maker.text(maker.ids_of(n_in))
            out.append(BenchRequest(text, maker.count(text), n_out))
    elif spec.kind == "sharegpt":
        # ShareGPT's conversations have long-tailed lengths: log-normal fits them well (prompt median
        # ~100 tokens, reply median ~200, both spanning two orders of magnitude). Generated locally.
        for _ in range(spec.num_prompts):
            n_in = _lognormal_len(rng, min(100, spec.max_input_len), 1.0, 4, spec.max_input_len)
            n_out = _lognormal_len(rng, min(200, spec.max_output_len), 0.8, 4, spec.max_output_len)
            text = maker.text(maker.ids_of(n_in))
            out.append(BenchRequest(text, maker.count(text), n_out))
    else:  # shared-prefix
        system = maker.text(maker.ids_of(spec.prefix_len))
        for _ in range(spec.num_prompts):
            question = maker.text(maker.ids_of(spec.question_len))
            text = system + "\n\n" + question
            out.append(BenchRequest(text, maker.count(text), spec.output_len))
    return out
