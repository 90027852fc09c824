"""The hierarchical cache on this machine: TTFT with the tiers vs without, and a cold vs warm restart.

    python bench/hicache.py [--families 8] [--prefix 768] [--turns 3] [--dtype float32]

Workload: ``families`` shared prefixes (a long system prompt each) of ``prefix`` tokens, each asked
``turns`` times with a new short question, round-robin over the families, one request at a time
(TTFT is then the prompt's prefill, or its load-back). L1 (the KV pool) holds a quarter of the working
set, so without the hierarchy each family's prefix is evicted before it comes back.

Rows (SmolLM2, one process, side by side in one run):
1. L1 only (the radix cache evicts and recomputes);
2. L1 + L2 (host pages, write_through);
3. L1 + L2 + L3 files, first start on an empty directory (cold);
4. the same directory after a restart (warm: the first request of each family prefetches from files).
Greedy outputs of every row must equal row 1's (checked; the script fails otherwise).

Writes bench/out/hicache.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def workload(families: int, prefix: int, turns: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(100, vocab) for _ in range(prefix)] for _ in range(families)]
    return [h + [rng.randrange(100, vocab) for _ in range(24)] for _ in range(turns) for h in heads]


def run(loaded, prompts: list[list[int]], l1_tokens: int, dtype: str, **hier) -> dict:
    from kvledger import Engine

    t0 = time.perf_counter()
    eng = Engine(loaded_model=loaded, dtype=dtype, page_size=16, max_total_tokens=l1_tokens, **hier)
    start_s = time.perf_counter() - t0
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    ttft, outs, cached = [], [], []
    for p in prompts:
        t = time.perf_counter()
        first = None
        for chunk in eng.generate(input_ids=p, sampling_params=sp, stream=True):
            if first is None and chunk["output_ids"]:
                first = time.perf_counter() - t
        ttft.append(first)
        outs.append(chunk["output_ids"])
        cached.append(chunk["meta_info"]["cached_tokens"])
    eng.run_until_idle()
    report = eng.audit()
    assert report.ok, report.describe()
    mem = eng.memory()
    eng.shutdown()
    n = len(prompts) // 2  # the first pass of each family is cold in every row but the warm restart
    return {
        "ttft_p50_ms": round(statistics.median(ttft) * 1000, 1),
        "ttft_p50_later_ms": round(statistics.median(ttft[n:]) * 1000, 1),
        "ttft_first_pass_p50_ms": round(statistics.median(ttft[: len(prompts) // 3 or 1]) * 1000, 1),
        "cached_fraction": round(sum(cached) / sum(len(p) for p in prompts), 3),
        "start_s": round(start_s, 2),
        "outputs": outs,
        "hicache": {k: v for k, v in mem.get("hicache", {}).items() if isinstance(v, int | float | str)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=768)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from kvledger.model import load_model

    loaded = load_model(None)
    prompts = workload(args.families, args.prefix, args.turns, loaded.config.vocab_size)
    working_set = args.families * (args.prefix + 24)
    l1 = working_set // 4 // 16 * 16
    rows = {}
    rows["L1 only"] = run(loaded, prompts, l1, args.dtype)
    rows["L1 + L2"] = run(loaded, prompts, l1, args.dtype, enable_hierarchical_cache=True, hicache_ratio=6)
    with tempfile.TemporaryDirectory() as d:
        l3 = dict(
            enable_hierarchical_cache=True,
            hicache_ratio=2,  # L2 too holds only half the working set: L3 matters
            hicache_storage_backend="file",
            hicache_storage_dir=d,
        )
        rows["L1 + L2 + L3, cold start"] = run(loaded, prompts, l1, args.dtype, **l3)
        rows["L1 + L2 + L3, warm restart"] = run(loaded, prompts, l1, args.dtype, **l3)
    want = rows["L1 only"]["outputs"]
    for name, r in rows.items():
        assert r.pop("outputs") == want, f"{name}: greedy output differs from L1 only"
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"families": args.families, "prefix": args.prefix, "turns": args.turns, "l1_tokens": l1,
            "working_set_tokens": working_set, "dtype": args.dtype}  # fmt: skip
    (out / "hicache.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{args.families} families x {args.prefix}-token prefix x {args.turns} turns, c=1; "
          f"L1 {l1} tokens = 1/4 of the working set ({working_set}); SmolLM2 {args.dtype}; outputs equal\n")  # fmt: skip
    print(
        "| configuration | TTFT p50 | TTFT p50, second half | cached / prompt tokens | L2 hit | L3 hit | start |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        h = r["hicache"]
        print(
            f"| {name} | {r['ttft_p50_ms']} ms | {r['ttft_p50_later_ms']} ms | {r['cached_fraction']:.0%} | "
            f"{h.get('l2_hit_tokens', 0)} | {h.get('l3_hit_tokens', 0)} | {r['start_s']} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
