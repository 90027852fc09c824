"""Concurrent streamed chat load against any OpenAI-compatible server.

    python bench/serve_load.py --url http://127.0.0.1:30000 --concurrency 32 --requests 32

Each request asks for exactly ``--output-len`` tokens (ignore_eos) after a ~``--input-len``-token
prompt. Reports output tok/s, TTFT and inter-token latency percentiles as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time

import httpx
from tqdm.auto import tqdm

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dogs",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
    "bold",
    "jovial",
    "kings",
]


def prompt_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def one(client: httpx.AsyncClient, model: str, text: str, out_len: int, bar) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": out_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, times, usage = None, [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                now = time.perf_counter()
                ttft = ttft if ttft is not None else now - t0
                times.append(now)
    bar.update(1)
    itl = [b - a for a, b in itertools.pairwise(times)]
    return {
        "ttft": ttft,
        "itl": itl,
        "e2e": time.perf_counter() - t0,
        "completion_tokens": (usage or {}).get("completion_tokens", len(times)),
        "prompt_tokens": (usage or {}).get("prompt_tokens", 0),
    }


async def run(args) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(args.concurrency)
        texts = [prompt_text(rng, int(args.input_len * 0.75)) for _ in range(args.requests)]
        bar = tqdm(total=args.requests, desc="requests")

        async def guarded(t):
            async with sem:
                return await one(client, model, t, args.output_len, bar)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(guarded(t) for t in texts))
        wall = time.perf_counter() - t0
        bar.close()
    out_tokens = sum(r["completion_tokens"] for r in res)
    ttft = [r["ttft"] for r in res if r["ttft"] is not None]
    itl = [x for r in res for x in r["itl"]]
    return {
        "model": model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "wall_s": wall,
        "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in res),
        "output_tok_s": out_tokens / wall,
        "request_s": len(res) / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
        "e2e_p50": pct([r["e2e"] for r in res], 50),
        "e2e_p99": pct([r["e2e"] for r in res], 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
