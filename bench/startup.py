"""Start-up cost of `kvledger serve`: time to /health and to a first chat answer, cold and warm, and
the memory the model takes.

Cold: empty kernel and tokenizer caches (every run compiles the C++ kernels and converts the GGUF's
tokenizer); warm: both caches filled by an untimed run first. Each run starts `kvledger serve` on a
free port, polls /health every 50 ms, asks one chat completion, reads `/get_server_info`
(`engine.weight_bytes`) and the peak resident memory of the front and engine processes
(`VmHWM` in /proc), then SIGTERMs the server. Medians of --runs runs each.

    python bench/startup.py --runs 3 [--model PATH] [--output bench/results/startup.json] [-- SERVE ARGS]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm(pid: int) -> int:
    """Peak resident set of a process in bytes (0 when gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def one_run(model: str | None, extra: list[str], kernels_dir: str, cache_dir: str, timeout: float) -> dict:
    port = free_port()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=kernels_dir, KVLEDGER_CACHE_DIR=cache_dir)
    cmd = [sys.executable, "-m", "kvledger", "serve", "--port", str(port), "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    t0 = time.monotonic()
    proc = subprocess.Popen([*cmd, *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    health = None
    try:
        with httpx.Client(timeout=120) as c:
            while time.monotonic() - t0 < timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
                try:
                    if c.get(base + "/health", timeout=1).status_code == 200:
                        health = time.monotonic() - t0
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            if health is None:
                raise RuntimeError(f"not healthy after {timeout} s")
            r = c.post(
                base + "/v1/chat/completions",
                json={"model": "default", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8},
            )
            r.raise_for_status()
            first_answer = time.monotonic() - t0
            info = c.get(base + "/get_server_info").json()
        engine_pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        peaks = {pid: vm_hwm(pid) for pid in engine_pids}
        return {
            "health_s": round(health, 2),
            "first_answer_s": round(first_answer, 2),
            "weight_bytes": info["engine"]["weight_bytes"],
            "front_peak_rss": vm_hwm(proc.pid),
            "engine_peak_rss": max(peaks.values(), default=0),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the shipped SmolLM2)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--output", default=None, help="write the runs and medians as JSON here")
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("serve_args", nargs="*", help="after --: extra `kvledger serve` arguments")
    args = ap.parse_args()

    from kvledger.model.loader import default_model_path

    path = args.model or default_model_path()
    result: dict = {"model": path, "file_bytes": os.path.getsize(path), "serve_args": args.serve_args}
    with tempfile.TemporaryDirectory(prefix="kvledger-startup-") as tmp:
        if not args.skip_cold:
            cold = []
            for i in range(args.runs):
                kd, cd = os.path.join(tmp, f"cold-k{i}"), os.path.join(tmp, f"cold-c{i}")
                cold.append(one_run(args.model, args.serve_args, kd, cd, args.timeout))
                print(f"cold {i + 1}/{args.runs}: {cold[-1]}", flush=True)
                shutil.rmtree(kd, ignore_errors=True)
            result["cold"] = {"runs": cold, "median": median_of(cold)}
        kd, cd = os.path.join(tmp, "warm-k"), os.path.join(tmp, "warm-c")
        one_run(args.model, args.serve_args, kd, cd, args.timeout)  # fills the caches
        warm = []
        for i in range(args.runs):
            warm.append(one_run(args.model, args.serve_args, kd, cd, args.timeout))
            print(f"warm {i + 1}/{args.runs}: {warm[-1]}", flush=True)
        result["warm"] = {"runs": warm, "median": median_of(warm)}
    mib = 2**20
    print(f"\nmodel file {result['file_bytes'] / mib:.0f} MiB")
    for kind in ("cold", "warm"):
        if kind in result:
            m = result[kind]["median"]
            print(
                f"{kind:>4} (median of {args.runs}): /health {m['health_s']:.1f} s, first answer "
                f"{m['first_answer_s']:.1f} s, weights {m['weight_bytes'] / mib:.0f} MiB "
                f"({m['weight_bytes'] / result['file_bytes']:.2f}x the file), peak RSS engine "
                f"{m['engine_peak_rss'] / mib:.0f} MiB, front {m['front_peak_rss'] / mib:.0f} MiB"
            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
