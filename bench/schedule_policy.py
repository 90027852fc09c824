"""Prefix-cache hit rate of the schedule policies (fcfs, lpm, dfs-weight) on a shared-prefix burst.

    python bench/schedule_policy.py [--families 6] [--prefix 256] [--questions 4] [--dtype float32]

Workload: ``families`` shared prefixes (a system prompt each) of ``prefix`` tokens, each asked
``questions`` short questions; every request arrives at once, round-robin over the families (the
order that defeats a cache too small for every prefix). The KV pool holds about two families' prefixes
beside the running requests, so what a policy admits next decides whether a prefix is still cached.
One engine per policy, the same prompts, greedy; in float32 every policy's outputs must equal
fcfs's (checked). Reported: cached prompt tokens / prompt tokens (``meta_info.cached_tokens``, the
prefix hit at admission) and the wall time of the burst.

Writes bench/out/schedule_policy.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

POLICIES = ("fcfs", "lpm", "dfs-weight")


def workload(families: int, prefix: int, questions: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(100, vocab) for _ in range(prefix)] for _ in range(families)]
    return [h + [rng.randrange(100, vocab) for _ in range(16)] for _ in range(questions) for h in heads]


def run(loaded, prompts: list[list[int]], policy: str, dtype: str, pool: int, running: int) -> dict:
    from kvledger import Engine

    eng = Engine(loaded_model=loaded, dtype=dtype, page_size=16, max_total_tokens=pool,
                 max_running_requests=running, chunked_prefill_size=512, schedule_policy=policy)  # fmt: skip
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    rids = [eng.add_request(p, sp, rid=f"q{i}") for i, p in enumerate(prompts)]
    eng.run_until_idle()
    wall = time.perf_counter() - t0
    res = [eng.result(r) for r in rids]
    report = eng.audit()
    assert report.ok, report.describe()
    retractions = eng.core.scheduler.total_retractions
    eng.shutdown()
    cached = sum(r["meta_info"]["cached_tokens"] for r in res)
    return {
        "policy": policy,
        "hit_rate": round(cached / sum(map(len, prompts)), 3),
        "cached_tokens": cached,
        "wall_s": round(wall, 2),
        "retractions": retractions,
        "outputs": [r["output_ids"] for r in res],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", type=int, default=6)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--running", type=int, default=4, help="--max-running-requests")
    ap.add_argument("--pool", type=int, default=0, help="KV pool tokens (default: ~2 prefixes + the running set)")
    ap.add_argument("--model", default=None, help="a model path (default: SmolLM2)")
    args = ap.parse_args()

    from kvledger.model import load_model

    loaded = load_model(args.model)
    prompts = workload(args.families, args.prefix, args.questions, loaded.config.vocab_size)
    pool = args.pool or (2 * args.prefix + args.running * (args.prefix + 32))
    pool -= pool % 16
    rows = [run(loaded, prompts, p, args.dtype, pool, args.running) for p in POLICIES]
    if args.dtype == "float32":
        for r in rows[1:]:
            assert r["outputs"] == rows[0]["outputs"], f"{r['policy']}'s outputs differ from fcfs's"
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    setup = {k: v for k, v in vars(args).items()} | {"pool_tokens": pool, "requests": len(prompts)}
    (out / "schedule_policy.json").write_text(
        json.dumps({"setup": setup, "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}, indent=1)
    )
    print(f"{len(prompts)} requests ({args.families} prefixes of {args.prefix} tokens x {args.questions}), "
          f"pool {pool} tokens, {args.running} running, {args.dtype}")  # fmt: skip
    print("| policy | cached / prompt tokens | wall | retractions |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['wall_s']} s | {r['retractions']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
