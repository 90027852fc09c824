"""bench/compare.py's pure parts: core lists, slot sizes, every peer's command line, result rows.

No peer runs here: the command lines are what the comparison's fairness rests on (threads pinned to
the cores given, llama-server's slots big enough for every row, both clients on the same settings).
"""

from __future__ import annotations

import shlex
import sys

import pytest

from tests.helpers import load_bench_script


@pytest.fixture(scope="module")
def compare():
    mod = load_bench_script("compare")
    yield mod
    sys.modules.pop("bench_compare", None)


def flag(cmd: list[str], name: str) -> str:
    """The value after ``name`` (exactly once) in ``cmd``."""
    assert cmd.count(name) == 1, (name, cmd)
    return cmd[cmd.index(name) + 1]


def test_cpu_lists(compare):
    assert compare.parse_cpu_list("0-1") == [0, 1]
    assert compare.parse_cpu_list("0-3,6, 2") == [0, 1, 2, 3, 6]
    assert compare.parse_cpu_list("5") == [5]
    for bad in ("", "1-0", "a", "0,,1", "-1"):
        with pytest.raises(ValueError):
            compare.parse_cpu_list(bad)
    assert compare.pinned("0-1", ["x", "-y"]) == ["taskset", "-c", "0-1", "x", "-y"]
    assert compare.pinned(None, ["x"]) == ["x"]


def test_slot_fits_the_longest_row(compare):
    # The 1,024-token prompt row and the 128/128 rows: a slot holds the longest prompt (with the
    # re-tokenization margin: 1,024 random ids re-tokenize to up to ~1,089) plus the most output.
    slot = compare.slot_tokens(128, 128, 1024)
    assert slot >= 1089 + 128
    assert slot % 64 == 0
    assert slot <= 2048  # no more than vLLM used to get (--max-model-len 2048)
    # Without the prefill row the random rows decide; a long output counts too.
    assert compare.slot_tokens(128, 128, 0) >= 128 + 128 + 64
    assert compare.slot_tokens(128, 4096, 1024) >= 1024 + 4096


def test_llama_server_threads_and_context(compare):
    slot = compare.slot_tokens(128, 128, 1024)
    cmd = compare.llama_server_cmd("/x/llama-server", "m.gguf", 32, slot, 2)
    assert flag(cmd, "-t") == "2" and flag(cmd, "-tb") == "2"
    assert flag(cmd, "-np") == "32"
    ctx = int(flag(cmd, "-c"))
    assert ctx == 32 * slot
    assert ctx >= 32 * (1024 + 128 + 64)  # each of the 32 slots takes the 1,024-token row
    assert flag(cmd, "-m") == "m.gguf" and flag(cmd, "--port") == "{port}"


def test_systems_pin_every_peer(compare, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'version: 1 (abc)'\necho 'built with cc'\n")
    fake.chmod(0o755)
    args = compare.parse_args(
        ["--cores", "0-1", "--llama-server", str(fake), "--concurrency", "1,8,64", "--model", "m.gguf"]
    )
    known = compare.systems(args)
    kv = known["kvledger"].cmd
    assert flag(kv, "--num-threads") == "2" and flag(kv, "--model") == "m.gguf"
    ll = known["llama-server"]
    assert flag(ll.cmd, "-np") == "64"  # one slot per stream at the highest level
    assert int(flag(ll.cmd, "-c")) == 64 * compare.slot_tokens(128, 128, 1024)
    assert flag(ll.cmd, "-t") == "2" and flag(ll.cmd, "-tb") == "2"
    assert "version: 1 (abc)" in ll.version
    assert known["transformers"].env["OMP_NUM_THREADS"] == "2"
    assert compare.pinned(args.cores, kv)[:3] == ["taskset", "-c", "0-1"]


def test_vllm_settings(compare):
    env = compare.vllm_env("0-1", 2, ["/lib/tcmalloc.so", "/v/lib/libiomp5.so"])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["LD_PRELOAD"] == "/lib/tcmalloc.so:/v/lib/libiomp5.so"
    assert "LD_PRELOAD" not in compare.vllm_env("0", 4, [])
    cmd = compare.vllm_server_cmd("/v/bin/python", "bfloat16", 1344)
    assert flag(cmd, "--max-model-len") == "1344" and flag(cmd, "--dtype") == "bfloat16"


def test_both_clients_get_the_same_level(compare):
    lv = compare.Level(input_len=128, output_len=128, num_prompts=32, concurrency=32, seed=2)
    kv = compare.kvledger_client_cmd("py", "http://h:1", "m", "tok.gguf", "sys", lv, "o.json")
    vl = compare.vllm_client_cmd("vpy", "http://h:1", "m", "/hf", lv, "v.json")
    assert (flag(kv, "--input-len"), flag(vl, "--random-input-len")) == ("128", "128")
    assert (flag(kv, "--output-len"), flag(vl, "--random-output-len")) == ("128", "128")
    assert (flag(kv, "--num-prompts"), flag(vl, "--num-prompts")) == ("32", "32")
    assert (flag(kv, "--concurrency"), flag(vl, "--max-concurrency")) == ("32", "32")
    assert (flag(kv, "--seed"), flag(vl, "--seed")) == ("2", "2")
    assert (flag(kv, "--warmup"), flag(vl, "--num-warmups")) == ("1", "1")
    # vLLM's client: streamed /v1/completions, EOS ignored, greedy, fixed lengths, all at once.
    assert flag(vl, "--endpoint") == "/v1/completions" and flag(vl, "--backend") == "openai"
    assert "--ignore-eos" in vl and flag(vl, "--temperature") == "0"
    assert flag(vl, "--random-range-ratio") == "0" and flag(vl, "--request-rate") == "inf"
    assert vl[1].endswith("bench/vllm_bench_client.py") and flag(vl, "--summary") == "v.json"
    assert flag(kv, "--tokenizer") == "tok.gguf" and flag(kv, "--output") == "o.json"
    # Levels differ in seed (no prefix-cache hits from the level before); prefill has no warm-up.
    args = compare.parse_args(["--concurrency", "1,8,32", "--num-prompts", "4"])
    levels = compare.random_levels(args)
    assert [(x.concurrency, x.num_prompts) for x in levels] == [(1, 4), (8, 8), (32, 32)]
    assert len({x.seed for x in levels}) == 3
    pre = compare.prefill_level(args)
    assert (pre.input_len, pre.output_len, pre.concurrency, pre.warmup) == (1024, 1, 1, 0)


def test_quick_is_a_smoke_run(compare):
    args = compare.parse_args(["--quick"])
    assert args.concurrency == "1" and args.num_prompts <= 4 and args.shared_prefix_len == 0
    assert args.client_cores == args.cores
    with pytest.raises(SystemExit):
        compare.parse_args(["--cores", "2-1"])


def test_shell_line_is_exact(compare):
    line = compare.shell_line(["taskset", "-c", "0-1", "a b", "--x"], {"K": "v w"})
    assert line == "K='v w' taskset -c 0-1 'a b' --x"
    assert shlex.split(line)[1:] == ["taskset", "-c", "0-1", "a b", "--x"]


def test_unique_labels(compare):
    assert compare.unique_labels(["kvledger", "vllm-cpu", "kvledger"]) == [
        ("kvledger", "kvledger"),
        ("vllm-cpu", "vllm-cpu"),
        ("kvledger", "kvledger#2"),
    ]


KV_RUN = {
    "concurrency": 8,
    "requests": 8,
    "completed": 8,
    "failed": 0,
    "duration_s": 4.0,
    "output_tok_s": 256.0,
    "input_tok_s": 260.0,
    "total_output_tokens": 1024,
    "ttft_ms": {"mean": 90.0, "p50": 80.0, "p90": 120.0, "p99": 150.0},
    "itl_ms": {"mean": 30.0, "p50": 28.0, "p90": 40.0, "p99": 60.0},
    "client_cpu_s": 1.25,
}

VLLM_SUMMARY = {
    "result": {
        "duration": 5.0,
        "completed": 31,
        "failed": 1,
        "total_input_tokens": 3968,
        "total_output_tokens": 3968,
        "output_throughput": 793.6,
        "max_concurrency": 32,
        "median_ttft_ms": 140.0,
        "p50_ttft_ms": 141.0,
        "p99_ttft_ms": 400.0,
        "p50_tpot_ms": 55.0,
        "p50_itl_ms": 54.0,
        "p99_itl_ms": 90.0,
    },
    "run_cpu_s": 3.5,
}


def test_rows_from_both_clients(compare):
    kv = compare.row_from_kvledger("kvledger", KV_RUN, 2.5, "py -m kvledger.bench ...")
    assert kv["client"] == "kvledger bench" and kv["concurrency"] == 8
    assert (kv["output_tok_s"], kv["ttft_p50_ms"], kv["itl_p50_ms"]) == (256.0, 80.0, 28.0)
    assert (kv["client_cpu_s"], kv["client_run_cpu_s"]) == (2.5, 1.25)
    assert kv["tpot_p50_ms"] is None
    vl = compare.row_from_vllm("vllm-cpu", VLLM_SUMMARY, 6.0, "vpy bench/vllm_bench_client.py ...")
    assert vl["client"] == "vllm bench serve" and vl["concurrency"] == 32
    assert (vl["requests"], vl["completed"], vl["failed"]) == (32, 31, 1)
    assert (vl["output_tok_s"], vl["ttft_p50_ms"], vl["tpot_p50_ms"]) == (793.6, 141.0, 55.0)
    assert vl["input_tok_s"] == pytest.approx(3968 / 5.0)
    assert (vl["client_cpu_s"], vl["client_run_cpu_s"]) == (6.0, 3.5)
    assert set(kv) == set(vl)  # one table for both
    bad = compare.failed_row("llama-server", "vllm bench serve", 1, "exit 1", "cmd")
    table = compare.rows_table([kv, vl, bad]).splitlines()
    assert len(table) == 5
    assert (
        "| kvledger | kvledger bench | 8 | 256 | 260 | 80.0 / 150 | - | 28.0 / 60.0 | 0 | 2.50 / 1.25 |"
        in table
    )
    assert (
        "| vllm-cpu | vllm bench serve | 32 | 794 | 794 | 141 / 400 | 55.0 | 54.0 / 90.0 | 1 | 6.00 / 3.50 |"
        in table
    )
    assert table[4].startswith("| llama-server | vllm bench serve | 1 | exit 1 |")
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_eos_ban_for_servers_that_refuse_ignore_eos(compare):
    import json
    from types import SimpleNamespace

    flags = compare.eos_ban_flags(SimpleNamespace(eos_token_id=2, all_special_ids=[0, 2, 5]))
    assert flags[:2] == ["--no-ignore-eos", "--extra-body"]
    assert json.loads(flags[2]) == {"logit_bias": {"0": -100, "2": -100, "5": -100}}


def test_one_token_rows_have_no_gaps(compare):
    # The prefill row (1 output token): vLLM reports TPOT/ITL 0; there is nothing to time.
    result = {**VLLM_SUMMARY["result"], "total_output_tokens": 31, "p50_tpot_ms": 0.0, "p50_itl_ms": 0.0}
    row = compare.row_from_vllm("vllm-cpu", {**VLLM_SUMMARY, "result": result}, 1.0, "cmd")
    assert row["tpot_p50_ms"] is None and row["itl_p50_ms"] is None and row["itl_p99_ms"] is None
    assert row["ttft_p50_ms"] == 141.0


def test_a_peer_that_does_not_start_fails_the_run(compare, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'version: 0' && exit 0\necho boom; exit 3\n")
    fake.chmod(0o755)
    common = ["--model", str(tmp_path / "m.gguf"), "--quick", "--cores", "0", "--systems", "llama-server"]
    assert compare.main([*common, "--llama-server", str(fake), "--out", str(tmp_path / "a")]) == 1
    rep = (tmp_path / "a" / "compare.json").read_text()
    assert "exited with 3: boom" in rep and '"did_not_start": [\n    "llama-server"' in rep
    # Not given at all: only a skip.
    assert compare.main([*common, "--out", str(tmp_path / "b")]) == 0
