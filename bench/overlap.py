"""Overlap scheduling on and off, side by side in one run (issue 32).

    python bench/overlap.py [--dtype bfloat16] [--new 48] [--rounds 2] [--model PATH]

Modes: ``on`` (overlap), ``thread`` (the forward on the same thread as with overlap, but each
step waits for the one before: what the thread alone changes), ``off`` (synchronous, the forward on
the engine's own thread). Output tok/s of greedy decode at 1 and 32 streams (32-token prompts,
``--new`` tokens each, EOS ignored), the modes interleaved ``--rounds`` times, every run in a
process of its own (two modes in one process disturb each other's OpenMP teams), the median round
reported with the range; with the host's share of a step (schedule + update on the engine thread)
and how many steps overlapped. On a shared machine the figures are noisy:
compare them within one run only. Writes bench/out/overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _timed_host(eng) -> dict:
    """Wrap the scheduler's two halves: seconds the engine thread spends in them."""
    s, acc = eng.core.scheduler, {"host_s": 0.0}

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc["host_s"] += time.perf_counter() - t0

        return run

    s.schedule, s.update = timed(s.schedule), timed(s.update)
    return acc


MODES = ("on", "thread", "off")  # overlap; forward thread but each step waits (no overlap); off


def run_one(loaded, mode: str, streams: int, new: int, dtype: str) -> dict:
    from kvledger import Engine
    from kvledger.scheduler import Scheduler

    overlap = mode != "off"
    if mode == "thread":  # the forward on its thread as with overlap, but every step waits for the last
        Scheduler.needs_sync = property(lambda self: bool(self.in_flight.flights))

    eng = Engine(loaded_model=loaded, dtype=dtype, page_size=16, max_total_tokens=streams * 128 + 512,
                 max_running_requests=max(streams, 8), disable_overlap_schedule=not overlap)  # fmt: skip
    vocab = eng.core.limits.vocab_size
    gen = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    eng.generate(input_ids=_prompts(2, 16, vocab, 99), sampling_params={**gen, "max_new_tokens": 4})  # warm-up
    acc = _timed_host(eng)
    steps0 = dict(eng.core.overlap_stats)
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=_prompts(streams, 32, vocab, 1), sampling_params=gen)
    wall = time.perf_counter() - t0
    ntok = sum(len(o["output_ids"]) for o in outs)
    st = {k: eng.core.overlap_stats[k] - steps0[k] for k in steps0}
    eng.shutdown()
    return {"tok_s": ntok / wall, "wall_s": wall, "host_s": acc["host_s"], "tokens": ntok, **st,
            "ids": [o["output_ids"] for o in outs]}  # fmt: skip


def _child(streams: int, mode: str, args) -> dict:
    """One run in a fresh process (``--one``); its result as JSON on the last line."""
    cmd = [sys.executable, __file__, "--one", f"{streams},{mode}", "--dtype", args.dtype, "--new", str(args.new)]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "streams,overlap": a child run
    args = ap.parse_args()
    import torch

    if args.one:
        from kvledger.model import load_model

        streams, mode = args.one.split(",")
        print(json.dumps(run_one(load_model(args.model), mode, int(streams), args.new, args.dtype)))
        return
    rows = []
    for streams in map(int, args.streams.split(",")):
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                runs[mode].append(_child(streams, mode, args))
        assert all(runs[m][0]["ids"] == runs["off"][0]["ids"] for m in MODES), "overlap changed the greedy outputs"
        for mode in MODES:
            rs = sorted(runs[mode], key=lambda r: r["tok_s"])
            med = rs[len(rs) // 2]
            rows.append({"streams": streams, "mode": mode, "tok_s_all": [round(r["tok_s"], 1) for r in rs],
                         **{k: v for k, v in med.items() if k != "ids"}})  # fmt: skip
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, {args.dtype}, {args.new} new tokens, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'streams':>7} {'mode':>7} {'tok/s':>8} {'rounds (tok/s)':>24} {'host s':>7} {'overlapped':>10} {'sync':>5}")
    for r in rows:
        print(f"{r['streams']:>7} {r['mode']:>7} {r['tok_s']:>8.1f} "
              f"{r['tok_s_all']!s:>24} {r['host_s']:>7.2f} {r['overlapped']:>10} {r['synchronous']:>5}")  # fmt: skip
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "overlap.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
