"""One stream on a model in three modes, each in its own process: ``loop`` (the Python per-layer loop,
``DECODE_IN_ONE_CALL`` off, and the head's full logits), ``call`` (the one-call C++ step,
``models/one_call.py``, full logits) and ``head`` (the one-call step and greedy tokens from the head in
C++, ``LMHead.greedy``). Output tokens a second after the first token, the one-call step's share of
the decodes, weights held and the process's resident memory. Offline (the ``Engine`` API, no HTTP), so the figures are the model's, not a server's.

    python bench/one_call_decode.py --model /path/to/gemma-3-270m-q4_k_m.gguf --rounds 3

Time it only on a quiet machine (the project's TIMING_LOCK where agents share one)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(model: str, mode: str, input_len: int, output_len: int, rounds: int) -> dict:
    from kvledger import Engine
    from kvledger.engine.runner import ModelRunner
    from kvledger.model import causal_lm

    causal_lm.DECODE_IN_ONE_CALL = mode != "loop"
    if mode != "head":
        ModelRunner._greedy_only = lambda self, sched, batch: False
    eng = Engine(model, max_total_tokens=4 * (input_len + output_len))
    m = eng.core.model
    loaded = rss_mib()
    sp = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    first = {**sp, "max_new_tokens": 1}
    rates = []
    for r in range(rounds + 1):  # round 0 warms up
        prompt = [1000 + 7 * r + i for i in range(input_len)]
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=prompt, sampling_params=first)
        t1 = time.perf_counter()
        eng.flush_cache()
        t2 = time.perf_counter()
        eng.generate(input_ids=prompt, sampling_params=sp)
        t3 = time.perf_counter()
        if r:
            rates.append((output_len - 1) / ((t3 - t2) - (t1 - t0)))
    out = {
        "mode": mode,
        "plan": m.net.decode_plan is not None,
        "one_call_forwards": m.one_call_forwards,
        "decode_tok_s": sorted(rates),
        "weight_mib": m.weight_bytes() / 2**20,
        "rss_loaded_mib": loaded,
        "rss_end_mib": rss_mib(),
    }
    eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="loop,call,head", help="comma-separated: loop, call, head")
    ap.add_argument("--child", choices=["loop", "call", "head"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.child, a.input_len, a.output_len, a.rounds)))
        return
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--model", a.model, "--input-len", str(a.input_len),
               "--output-len", str(a.output_len), "--rounds", str(a.rounds), "--child", mode]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
