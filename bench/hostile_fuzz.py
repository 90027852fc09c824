"""The hostile-client fuzz, longer than the test suite runs it (issue 50).

Starts ``kvledger serve`` (a tiny random chat model built here, or ``--model``) with two tenants'
keys and an admin key, owns a few sessions and stored responses as tenant A, then for ``--minutes``
runs seeded attacks of every kind from tests/fuzz/hostile_http.py (random, oversized, deeply nested,
wrongly typed or encoded bodies, wrong content types, stalled and vanishing clients, unknown and
the other tenant's ids, junk paths) beside a bystander whose greedy answer must never change. Then
the PD bootstrap port's and the TP ports' hostile tests (tests/fuzz/test_hostile_pd.py, _tp.py) run
``--rounds`` times. It prints each problem found and a summary, and exits 1 if there was any, if
the engine restarted, or if the books were not clean at the end.

    python bench/hostile_fuzz.py --minutes 10 --seed 7
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter

from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.fuzz import hostile_http
from tests.fuzz.test_hostile_http import KEYS, Bystander
from tests.helpers import build_tiny_chat_model
from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a model directory or GGUF (default: a tiny random chat model)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of the PD and TP hostile test modules")
    ap.add_argument("--body-timeout", type=float, default=2.0)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvledger-hostile-")
    model = args.model or build_tiny_chat_model(os.path.join(work, "tiny_chat"))
    server = Server(model, *ENGINE_ARGS, "--api-key", *KEYS, "--admin-api-key", "admin-key",
                    "--body-timeout", str(args.body_timeout), log_path=os.path.join(work, "server.log"))  # fmt: skip
    failed = False
    try:
        server.wait_healthy(timeout=600)
        server.headers = {"Authorization": "Bearer admin-key"}
        restarts = server.info()["engine_restarts"]
        target = hostile_http.Target(server.url, KEYS, max_body_bytes=200000, body_timeout_s=args.body_timeout)
        hostile_http.own_things(target)
        bystander = Bystander(server.url, KEYS[1])
        bystander.start()
        rng, kinds, problems = random.Random(args.seed), Counter(), []
        deadline = time.monotonic() + args.minutes * 60
        with tqdm(desc="attacks", unit="attack") as bar:
            while time.monotonic() < deadline:
                for kind, attack in hostile_http.attacks(rng, 13):
                    kinds[kind] += 1
                    problem = hostile_http.judge(kind, attack(target), target)
                    if problem:
                        problems.append(problem)
                        tqdm.write(f"PROBLEM {problem}")
                    bar.update()
        bystander.stop.set()
        bystander.join(60)
        info = server.wait_idle_clean(timeout=60)
        print(f"HTTP: {sum(kinds.values())} attacks ({dict(kinds)}), {len(problems)} problems; bystander "
              f"{bystander.runs} answers, {len(bystander.errors)} wrong or failed; engine restarts "
              f"{info['engine_restarts'] - restarts}; books clean")  # fmt: skip
        failed = bool(problems or bystander.errors or info["engine_restarts"] != restarts)
    except AssertionError as e:  # the books were not clean
        print(f"the books were not clean at the end: {e}")
        failed = True
    finally:
        server.stop()
    root = os.path.join(os.path.dirname(__file__), "..")
    for r in range(args.rounds):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fuzz/test_hostile_pd.py",
               "tests/fuzz/test_hostile_tp.py"]  # fmt: skip
        print(f"PD and TP ports, round {r + 1}: {' '.join(cmd[2:])}")
        failed |= subprocess.run(cmd, cwd=root).returncode != 0
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
