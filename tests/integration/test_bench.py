"""`kvledger bench` and bench/compare.py run end to end at a tiny scale, so they cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.bench import add_bench_args, run_bench

ROOT = Path(__file__).resolve().parents[2]


def _args(url: str, **over):
    import argparse

    p = argparse.ArgumentParser()
    add_bench_args(p)
    ns = p.parse_args([])
    ns.base_url = url
    ns.progress = False
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def test_bench_cli_random_workload_json_and_plot(srv, chat_model, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [sys.executable, "-m", "kvledger", "bench", "--base-url", srv.url, "--tokenizer", chat_model]
    cmd += ["--concurrency", "1,3", "--num-prompts", "3", "--input-len", "24", "--output-len", "5"]
    cmd += [
        "--range-ratio",
        "0.5",
        "--output",
        str(out),
        "--plot",
        str(png),
        "--label",
        "tiny",
        "--no-progress",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| tiny | 3 |" in r.stdout  # the table
    rep = json.loads(out.read_text())
    assert [run["concurrency"] for run in rep["runs"]] == [1, 3]
    for run in rep["runs"]:
        assert run["completed"] == run["requests"] == 3 and run["failed"] == 0
        # ignore_eos: every request produced exactly what the workload asked (3..5 tokens each)
        assert 9 <= run["total_output_tokens"] <= 15
        assert run["ttft_ms"]["p50"] > 0 and run["e2e_ms"]["p99"] >= run["ttft_ms"]["p99"]
        assert run["itl_ms"]["p50"] is not None and run["output_tok_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("workload", ["sharegpt", "shared-prefix"])
def test_bench_other_workloads(srv, tiny_chat_tokenizer, workload):
    args = _args(
        srv.url,
        workload=workload,
        num_prompts=4,
        concurrency="2",
        max_input_len=60,
        max_output_len=6,
        prefix_len=80,
        question_len=8,
        output_len=3,
        endpoint="chat" if workload == "sharegpt" else "completions",
    )
    rep = run_bench(args, tiny_chat_tokenizer)
    (run,) = rep["runs"]
    assert run["completed"] == 4, run["errors"]
    assert rep["workload"]["kind"] == workload
    if workload == "shared-prefix":
        # warm-up put the system prompt in the prefix cache: the server reports reuse
        assert srv.info()["memory"]["kv_cached_evictable"] > 0


def test_bench_reports_a_server_error_as_failed_requests(srv, tiny_chat_tokenizer):
    rep = run_bench(
        _args(srv.url, model="no-such-model", concurrency="1", num_prompts=1, warmup=0), tiny_chat_tokenizer
    )
    (run,) = rep["runs"]
    assert run["failed"] == 1 and "HTTP 404" in run["errors"][0]


def test_compare_script_runs_kvledger_and_transformers(chat_model, tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "compare.py"), "--model", chat_model, "--dtype", "float32"]
    cmd += ["--systems", "kvledger,transformers,llama-server", "--concurrency", "1,2", "--num-prompts", "2"]
    cmd += ["--input-len", "16", "--output-len", "4", "--shared-prefix-len", "48", "--shared-questions", "3"]
    cmd += ["--shared-concurrency", "2", "--prefill-len", "32", "--out", str(tmp_path), "--cores", "0"]
    cmd += ["--kvledger-args", "--max-total-tokens 2048 --strict-memory"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / "compare.json").read_text())
    assert set(rep["systems"]) == {"kvledger", "kvledger-nocache", "transformers"}
    assert rep["skipped"] == {"llama-server": "no --llama-server binary given"}
    for entry in rep["systems"].values():
        assert "error" not in entry, entry
        assert entry["version"] and entry["rss_mb"] > 0
        # every server pinned to the cores given, with as many threads
        assert entry["command"].startswith("taskset -c 0 ") or " taskset -c 0 " in entry["command"]
    assert "--num-threads 1" in rep["systems"]["kvledger"]["command"]
    assert rep["systems"]["kvledger"]["kv_capacity_tokens"] == 2048
    for name in ("kvledger", "transformers"):
        rows = [row for row in rep["random"] if row["system"] == name]
        assert [row["concurrency"] for row in rows] == [1, 2]
        for row in rows:
            assert row["client"] == "kvledger bench" and row["failed"] == 0
            assert row["total_output_tokens"] == 4 * row["requests"]
            # the client's own CPU time, whole process and timed part, and its exact command line
            assert row["client_cpu_s"] > row["client_run_cpu_s"] > 0
            assert row["client_command"].startswith("taskset -c 0 ")
        (pre,) = [row for row in rep["prefill"] if row["system"] == name]
        assert pre["completed"] == 4 and pre["ttft_p50_ms"] > 0
    (shared,) = [row for row in rep["shared_prefix"] if row["system"] == "kvledger"]
    assert shared["completed"] == 3
    assert (tmp_path / "compare.png").stat().st_size > 1000
    md = (tmp_path / "compare.md").read_text()
    assert "## Random workload" in md and "client CPU s" in md and "--num-threads 1" in md
