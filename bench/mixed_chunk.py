"""Mixed chunks on vs off, side by side: requests arriving while others decode.

python bench/mixed_chunk.py [--requests 64] [--dtype auto] [--chunked-prefill-size 512]

Two arrival patterns, each run with mixed chunks on and off, alternating twice in one process:
- ``waves``: a wave of 8 new requests whenever fewer than 8 run (prefills keep landing while
  others decode, the case mixed chunks are for);
- ``burst``: 32 requests at once, then a new one as each finishes (a closed loop of 32 clients,
  as ``kvledger bench --concurrency 32`` drives a server).

TTFT is measured from each request's arrival (its ``add_request``) to its first output token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvledger import Engine
from kvledger.model import load_model


def run(loaded, mixed: bool, pattern: str, args) -> dict:
    eng = Engine(
        loaded_model=loaded,
        dtype=args.dtype,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_mixed_chunk=mixed,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(args.requests)]
    sp = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    eng.generate(input_ids=prompts[0][:8], sampling_params={**sp, "max_new_tokens": 2})
    eng.flush_cache()
    t0 = time.perf_counter()
    arrived, first, gaps, last = {}, {}, [], {}
    pending = list(prompts)

    def add(n: int) -> None:
        for _ in range(min(n, len(pending))):
            arrived[eng.add_request(pending.pop(0), sp)] = time.perf_counter()

    add(8 if pattern == "waves" else 32)
    while pending or not eng.core.scheduler.idle:
        running = len(eng.core.scheduler.running) + len(eng.core.scheduler.waiting)
        if pattern == "waves" and running < 8:
            add(8)
        elif pattern == "burst" and running < 32:
            add(32 - running)
        for out in eng.step():
            if not out.new_ids:
                continue
            now = time.perf_counter()
            if out.rid not in first:
                first[out.rid] = now - arrived[out.rid]
            else:
                gaps.append(now - last[out.rid])
            last[out.rid] = now
    dt = time.perf_counter() - t0
    tokens = sum(len(eng.result(r)["output_ids"]) for r in arrived)
    gaps.sort()
    return {
        "pattern": pattern,
        "mixed": mixed,
        "output_tok_s": round(tokens / dt, 1),
        "ttft_p50_s": round(statistics.median(first.values()), 3),
        "itl_p50_ms": round(1e3 * gaps[len(gaps) // 2], 1),
        "itl_p99_ms": round(1e3 * gaps[int(len(gaps) * 0.99)], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunked-prefill-size", type=int, default=512)
    args = ap.parse_args()
    loaded = load_model(None)
    runs = [run(loaded, m, p, args) for p in ("waves", "burst") for m in (True, False, True, False)]
    for r in runs:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
