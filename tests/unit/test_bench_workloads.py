"""Benchmark workloads are reproducible from a seed and have the lengths they promise."""

from __future__ import annotations

import pytest

from kvledger.bench.client import RequestResult
from kvledger.bench.report import percentile, summarize
from kvledger.bench.workloads import WorkloadSpec, make_workload


@pytest.fixture(scope="module")
def tok(tiny_chat_tokenizer):
    return tiny_chat_tokenizer


def test_same_seed_same_workload(tok):
    spec = WorkloadSpec(kind="random", num_prompts=5, input_len=40, output_len=9, range_ratio=0.5, seed=3)
    a, b = make_workload(spec, tok), make_workload(spec, tok)
    assert a == b
    assert make_workload(WorkloadSpec(kind="random", num_prompts=5, input_len=40, seed=4), tok) != a
    for r in a:
        assert 4 <= r.output_len <= 9
        assert r.input_len == len(tok.encode(r.prompt, add_special_tokens=False))
        assert 10 <= r.input_len <= 80  # byte-level text of 20..40 random ids re-tokenizes near that


def test_sharegpt_lengths_are_long_tailed_and_clipped(tok):
    reqs = make_workload(
        WorkloadSpec(kind="sharegpt", num_prompts=200, max_input_len=300, max_output_len=150), tok
    )
    outs = sorted(r.output_len for r in reqs)
    assert outs[0] >= 4 and outs[-1] <= 150
    assert outs[len(outs) // 2] < outs[-1]  # spread, not one fixed length
    assert len(set(outs)) > 20


def test_shared_prefix_prompts_share_one_system_prompt(tok):
    reqs = make_workload(
        WorkloadSpec(kind="shared-prefix", num_prompts=6, prefix_len=64, question_len=8), tok
    )
    system = reqs[0].prompt.split("\n\n")[0]
    assert len(system) > 20
    assert all(r.prompt.startswith(system + "\n\n") for r in reqs)
    assert len({r.prompt for r in reqs}) == 6


def test_unknown_workload_is_refused(tok):
    with pytest.raises(ValueError):
        make_workload(WorkloadSpec(kind="nope"), tok)


def test_summary_percentiles_and_throughput():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([], 50) is None
    rs = [
        RequestResult(True, 10, 5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
        RequestResult(False, 10, error="HTTP 500"),
    ]
    s = summarize(rs, wall_s=2.0)
    assert s["completed"] == 1 and s["failed"] == 1 and s["errors"] == ["HTTP 500"]
    assert s["output_tok_s"] == 2.5 and s["input_tok_s"] == 5.0
    assert s["ttft_ms"]["p50"] == pytest.approx(100) and s["itl_ms"]["p99"] == pytest.approx(100)
