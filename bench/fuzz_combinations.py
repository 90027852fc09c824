"""The combination fuzz, long: every configuration of the compatibility table's covering array, and
random ones, under the random workload of tests/fuzz/workload.py until ``--steps`` engine steps.

    python bench/fuzz_combinations.py --steps 100000              # the issue's long run
    python bench/fuzz_combinations.py --steps 3000 --run-steps 300  # a quick look

Each run starts one configuration's engines (tiny random chat models built here: a target and a draft
of the same tokenizer), drives ``--run-steps`` steps of the workload with strict books (a violation
raises at the step it happens), audits at idle points and at the end, and in fp32 compares every
deterministic output with a plain engine's. A failed run counts as a violation (its first line is
printed) and the next run starts fresh. Prints combinations x runs x steps x violations, the allowed
pairs exercised and those not run here (the CUDA ones without a CUDA device). Exit status 1 on any
violation or an allowed pair this machine can run that no run exercised.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import combos
from tests.fuzz.workload import PDPair, Reference, Single, Workload
from tests.helpers import build_tiny_chat_model

from kvledger import Engine
from kvledger.model import load_model


def random_row(rng: random.Random) -> combos.Row:
    """A configuration drawn at random: each feature this machine runs joins with probability 0.4
    when the table allows it beside those already in (what it needs comes with it)."""
    row: set[str] = set()
    features = [f for f in combos.runnable_here() if f not in combos.REQUEST_LEVEL]
    rng.shuffle(features)
    for f in features:
        cand = row | {f} | ({combos.REQUIRES[f]} if f in combos.REQUIRES else set())
        if rng.random() < 0.4 and combos.compatible(cand):
            row = cand
    row |= {f for f in combos.REQUEST_LEVEL if combos.compatible(row | {f})}
    return frozenset(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100_000, help="engine steps in all")
    ap.add_argument("--run-steps", type=int, default=2000, help="steps of one run (one configuration)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-share", type=float, default=0.5, help="share of runs on random configurations")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="kvledger-fuzz-")
    model = build_tiny_chat_model(f"{tmp}/chat")
    drafts = [model, build_tiny_chat_model(f"{tmp}/draft", seed=6)]
    loaded = load_model(model)
    ref_eng = Engine(loaded_model=loaded, dtype="float32", page_size=16, max_total_tokens=8192,
                     enable_prefix_cache=False, strict_memory=True)  # fmt: skip
    ref = Reference(ref_eng)
    rows = combos.covering_array()
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # row -> runs, steps, violations
    exercised: set[frozenset[str]] = set()
    failures: list[str] = []
    steps = runs = 0
    t0 = time.monotonic()
    while steps < args.steps:
        row = (
            random_row(rng)
            if runs >= len(rows) and rng.random() < args.random_share
            else rows[runs % len(rows)]
        )
        n = min(args.run_steps, args.steps - steps)
        seed = rng.randrange(2**31)
        run_rng = random.Random(seed)
        name = combos.row_id(row)
        started = None
        try:
            started = combos.start(row, model, loaded, run_rng.choice(drafts), f"{tmp}/run{runs}", run_rng)
            target = PDPair(*started.engines, started.port) if started.pd else Single(started.engines[0])
            Workload(target, ref, run_rng, combos.exact(row), loaded.tokenizer).run(n)
        except Exception as e:  # a violation: the books, an output, a hang, or an engine error
            table[name][2] += 1
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            failures.append(f"{name} seed {seed}: {type(e).__name__}: {first[:300]}")
            print("VIOLATION", failures[-1], flush=True)
            traceback.print_exc(limit=3)
        finally:
            if started is not None:
                try:
                    started.shutdown()
                except Exception as e:
                    table[name][2] += 1
                    failures.append(f"{name} seed {seed}: shutdown: {e}")
        table[name][0] += 1
        table[name][1] += n
        exercised |= combos.pairs(row)
        steps += n
        runs += 1
        print(f"[{time.monotonic() - t0:7.0f}s] run {runs}: {name} ({n} steps, seed {seed}); "
              f"{steps}/{args.steps} steps, {len(failures)} violations", flush=True)  # fmt: skip

    allowed = combos.allowed_pairs()
    here = combos.allowed_pairs(combos.runnable_here())
    missing = sorted(tuple(sorted(p)) for p in here - exercised)
    print("\n| combination | runs | steps | violations |\n|---|---|---|---|")
    for name, (r, s, v) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {r} | {s} | {v} |")
    total_v = sum(v for _, _, v in table.values())
    print(f"\n{len(table)} combinations x {steps} steps x {total_v} violations in {time.monotonic() - t0:.0f}s; "
          f"{len(exercised & allowed)} of {len(allowed)} allowed pairs exercised")  # fmt: skip
    print(f"not run here (no CUDA device): {sorted(tuple(sorted(p)) for p in allowed - here)}")
    if missing:
        print(f"allowed pairs this machine runs that no run exercised: {missing}")
    for f in failures:
        print("  ", f)
    ref_eng.shutdown()
    return 1 if total_v or missing else 0


if __name__ == "__main__":
    sys.exit(main())
