"""Chaos, longer: rounds of kill -9 and SIGSTOP of the engine under load with sessions open, each
followed by a flood of disconnecting clients (the rules are tests/chaos.py's; CI runs 2 rounds).

    python bench/chaos.py --rounds 10                  # SmolLM2 (default model), starts its own server
    python bench/chaos.py --model DIR --rounds 4       # any model directory or GGUF

Prints one JSON line per round (signal, how fast the front noticed, how long until healthy again,
the answers the load got) and a summary; exits 1 if any rule broke or the books do not balance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.chaos import chaos
from tests.server_harness import Server, process_alive


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the shipped SmolLM2)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--flood", type=int, default=48, help="disconnecting clients per round")
    p.add_argument("--watchdog", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    log = Path(tempfile.mkdtemp(prefix="kvledger-chaos-")) / "server.log"
    s = Server(
        args.model,
        "--strict-memory",
        "--watchdog-timeout",
        str(args.watchdog),
        "--max-sessions",
        str(max(8, args.sessions)),
        "--log-level",
        "warning",
        log_path=str(log),
    )
    ok = True
    pids: list[int] = []
    try:
        s.wait_healthy(timeout=600)
        vocab = s.info()["engine"]["vocab_size"]
        try:
            report = asyncio.run(
                chaos(s.url, args.rounds, vocab, args.watchdog, args.seed, args.sessions, args.flood)
            )
        except AssertionError as e:
            print(f"RULE BROKEN: {e}", file=sys.stderr)
            return 1
        for r in report:
            print(json.dumps(r))
        pids = [r["pid"] for r in report]
        info = s.wait_idle_clean(timeout=30)
        pids.append(info["engine_pid"])
        summary = {
            "rounds": len(report),
            "engine_restarts": info["engine_restarts"],
            "noticed_s_max": max(r["noticed_s"] for r in report),
            "back_s_median": statistics.median(r["back_s"] for r in report),
            "audits": info["memory"]["leak_check"]["checks"],
            "violations": info["memory"]["leak_check"]["violations"],
        }
        print(json.dumps({"summary": summary}))
        ok = summary["violations"] == 0
    finally:
        code = s.stop()
    left = [p for p in pids if process_alive(p)]
    if code != 0 or left:
        print(f"server exit code {code}; engine processes left: {left}", file=sys.stderr)
        ok = False
    print(f"server log: {log}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
