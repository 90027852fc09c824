"""Soak: mixed traffic against a real server with a small KV pool (forcing retraction and eviction),
bounded in time; then the books must balance.

    python bench/soak.py --duration 600                       # SmolLM2, starts its own server
    python bench/soak.py --model DIR --duration 60 --small    # a tiny model, CI scale

Traffic: normal and streamed requests, streams dropped half-way (disconnects), multi-turn sessions
(some closed mid-turn), bad inputs, aborts by rid, health checks, and a canary request every second.
Reports requests served, answers by status, leaks found by the audit (must be 0), server RSS at start
and end, and the canary's latency p50/p99 per minute. Exits 1 if the books do not balance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_harness import Server, books_balance, wait_idle


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def worker(c: httpx.AsyncClient, rng: random.Random, stop: float, stats: Counter, vocab: int) -> None:
    sessions: list[str] = []
    while time.monotonic() < stop:
        kind = rng.choices(
            ["normal", "stream", "drop", "session", "bad", "abort", "health"], [30, 15, 10, 20, 10, 8, 7]
        )[0]
        ids = [rng.randrange(3, vocab) for _ in range(rng.choice([5, 30, 120, 300]))]
        sp = {"max_new_tokens": rng.choice([1, 8, 32, 96]), "temperature": rng.choice([0, 0.8])}
        try:
            if kind == "normal":
                r = await c.post("/generate", json={"input_ids": ids, "sampling_params": sp})
                stats[f"normal {r.status_code}"] += 1
            elif kind in ("stream", "drop"):
                async with c.stream(
                    "POST", "/generate", json={"input_ids": ids, "sampling_params": sp, "stream": True}
                ) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data:")
                        if kind == "drop" and n >= 2:
                            break  # disconnect mid-stream
                    stats[f"{kind} {r.status_code}"] += 1
            elif kind == "session":
                if not sessions or rng.random() < 0.2:
                    r = await c.post("/open_session", json={"timeout": 30})
                    stats[f"open_session {r.status_code}"] += 1
                    if r.status_code == 200:
                        sessions.append(r.json())
                    continue
                sid = rng.choice(sessions)
                turn = asyncio.create_task(
                    c.post(
                        "/generate",
                        json={"input_ids": ids[:40], "sampling_params": sp, "session_params": {"id": sid}},
                    )
                )
                if rng.random() < 0.15:
                    await asyncio.sleep(0.05)
                    await c.post("/close_session", json={"session_id": sid})
                    sessions.remove(sid)
                r = await turn
                stats[f"session_turn {r.status_code}"] += 1
                if r.status_code == 404 and sid in sessions:
                    sessions.remove(sid)  # expired
            elif kind == "bad":
                body = rng.choice(
                    [
                        {"input_ids": []},
                        {"input_ids": [vocab + 5]},
                        {"text": 5},
                        {"input_ids": [1], "sampling_params": {"temperature": -1}},
                        {"input_ids": [1] * 100000},
                    ]
                )
                r = await c.post("/generate", json=body)
                stats[f"bad {r.status_code}"] += 1
            elif kind == "abort":
                rid = f"soak-{rng.randrange(1 << 30)}"
                t = asyncio.create_task(
                    c.post(
                        "/generate",
                        json={"input_ids": ids, "rid": rid, "sampling_params": {**sp, "max_new_tokens": 200}},
                    )
                )
                await asyncio.sleep(rng.random() * 0.3)
                await c.post("/abort_request", json={"rid": rid})
                r = await t
                stats[f"aborted {r.status_code}"] += 1
            else:
                r = await c.get(rng.choice(["/health", "/health_generate"]))
                stats[f"health {r.status_code}"] += 1
        except httpx.HTTPError as e:
            stats[f"{kind} client-error {type(e).__name__}"] += 1
    for sid in sessions:
        await c.post("/close_session", json={"session_id": sid})


async def canary(c: httpx.AsyncClient, stop: float, samples: list[tuple[float, float]], t0: float) -> None:
    while time.monotonic() < stop:
        t = time.perf_counter()
        r = await c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
        if r.status_code == 200:
            samples.append((time.monotonic() - t0, time.perf_counter() - t))
        await asyncio.sleep(1.0)


async def run(url: str, duration: float, workers: int, seed: int, vocab: int) -> dict:
    stats: Counter = Counter()
    samples: list[tuple[float, float]] = []
    t0 = time.monotonic()
    stop = t0 + duration
    limits = httpx.Limits(max_connections=workers * 2 + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        await asyncio.gather(
            canary(c, stop, samples, t0),
            *(worker(c, random.Random(seed + i), stop, stats, vocab) for i in range(workers)),
        )
    by_minute: dict[int, list[float]] = {}
    for at, lat in samples:
        by_minute.setdefault(int(at // 60), []).append(lat)
    canary_stats = {
        f"minute {m}": {"p50": statistics.median(v), "p99": sorted(v)[min(len(v) - 1, int(0.99 * len(v)))]}
        for m, v in sorted(by_minute.items())
    }
    return {"answers": dict(sorted(stats.items())), "requests": sum(stats.values()), "canary": canary_stats}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="an already running server (default: start one)")
    ap.add_argument("--model", default=None, help="model for the started server (default SmolLM2)")
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="tiny pool and context (CI scale)")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--audit-interval-s", type=float, default=10.0, help="busy-audit interval of the started server"
    )
    args = ap.parse_args()
    server = None
    if args.url is None:
        pool = (
            ["--max-total-tokens", "1024", "--context-length", "512"]
            if args.small
            else ["--max-total-tokens", "4096"]
        )
        server = Server(
            args.model,
            "--strict-memory",
            "--page-size",
            "16",
            "--max-running-requests",
            "16",
            "--max-queued-requests",
            "64",
            "--max-sessions",
            "16",
            "--log-level",
            "warning",
            "--audit-interval-s",
            str(args.audit_interval_s),
            *pool,
            log_path="/tmp/kvledger-soak-server.log",
        )
        server.wait_healthy(timeout=300)
        url = server.url
    else:
        url = args.url
    info = httpx.get(url + "/get_server_info").json()
    vocab = info["engine"]["vocab_size"]
    pids = {"front": server.proc.pid if server else None, "engine": info["engine_pid"]}
    rss_start = {k: rss_mb(p) for k, p in pids.items() if p}
    report = asyncio.run(run(url, args.duration, args.workers, args.seed, vocab))
    # Books: once idle nothing private, nothing protected, every slot free, no audit violation.
    info, idle = wait_idle(url, timeout=30)
    m = info["memory"]
    pids["engine"] = info["engine_pid"]
    report.update(
        {
            "duration_s": args.duration,
            "idle_clean": idle and books_balance(info),
            "leaks": m["leak_check"]["violations"],
            "audits": m["leak_check"]["checks"],
            "engine_restarts": info["engine_restarts"],
            "memory": m,
            "rss_mb_start": rss_start,
            "rss_mb_end": {k: rss_mb(p) for k, p in pids.items() if p},
        }
    )
    if server:
        report["server_exit_code"] = server.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    ok = report["idle_clean"] and report["leaks"] == 0 and report["engine_restarts"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
