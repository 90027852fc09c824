"""What ``--enable-deterministic-inference`` costs, side by side in one run (issue 56).

    python bench/deterministic.py [--model PATH] [--prompt 128] [--new 128] [--rounds 3] [--prefill 1024]

Output tok/s of greedy decode at 1 and 32 streams (``--prompt``-token prompts, ``--new`` tokens
each, EOS ignored), and the prefill rate of one ``--prefill``-token prompt, with the default settings
and with the flag, the two interleaved ``--rounds`` times, every run in a process of its own (two
engines in one process disturb each other's OpenMP teams), the median round reported with the range.
Also checks what the flag promises: under it, the first prompt's tokens at 32 streams equal its
tokens alone. On a CPU without AMX the two modes run the same kernels for the default model (the
figures should agree within noise); on one with AMX the flag gives up the AMX paths (prefill and
large batches). On a shared machine the figures are noisy: compare them within one run only, on a
quiet machine. Writes bench/out/deterministic.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = {"default": {}, "deterministic": {"enable_deterministic_inference": True}}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def run_one(model: str | None, mode: str, what: str, args) -> dict:
    """One measurement in this process: ``what`` is a stream count (decode) or ``prefill``."""
    from kvledger import Engine
    from kvledger.model import load_model

    streams = 1 if what == "prefill" else int(what)
    eng = Engine(loaded_model=load_model(model), page_size=16, max_running_requests=max(streams, 8),
                 max_total_tokens=streams * (args.prompt + args.new) + args.prefill + 1024, **MODES[mode])  # fmt: skip
    vocab = eng.core.limits.vocab_size
    gen = {"max_new_tokens": args.new, "temperature": 0, "ignore_eos": True}
    eng.generate(input_ids=_prompts(2, 16, vocab, 99), sampling_params={**gen, "max_new_tokens": 4})  # warm-up
    if what == "prefill":
        prompt = _prompts(1, args.prefill, vocab, 7)[0]
        t0 = time.perf_counter()
        eng.generate(input_ids=prompt, sampling_params={**gen, "max_new_tokens": 1})
        wall = time.perf_counter() - t0
        eng.shutdown()
        return {"tok_s": args.prefill / wall, "wall_s": wall, "ids": []}
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=_prompts(streams, args.prompt, vocab, 1), sampling_params=gen)
    wall = time.perf_counter() - t0
    eng.shutdown()
    ntok = sum(len(o["output_ids"]) for o in outs)
    return {"tok_s": ntok / wall, "wall_s": wall, "ids": [o["output_ids"] for o in outs]}


def _child(what: str, mode: str, args) -> dict:
    """One run in a fresh process (``--one``); its result as JSON on the last line."""
    cmd = [sys.executable, __file__, "--one", f"{what},{mode}", "--prompt", str(args.prompt), "--new",
           str(args.new), "--prefill", str(args.prefill)]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: SmolLM2)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of each stream")
    ap.add_argument("--new", type=int, default=128, help="new tokens of each stream")
    ap.add_argument("--prefill", type=int, default=1024, help="tokens of the prefill prompt (0: skip)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "what,mode": a child run
    args = ap.parse_args()
    if args.one:
        what, mode = args.one.split(",")
        print(json.dumps(run_one(args.model, mode, what, args)))
        return
    import torch

    whats = args.streams.split(",") + (["prefill"] if args.prefill else [])
    runs: dict[tuple[str, str], list[dict]] = {(w, m): [] for w in whats for m in MODES}
    for _ in range(args.rounds):
        for w in whats:
            for m in MODES:  # interleaved: both modes see the same machine state, round by round
                runs[(w, m)].append(_child(w, m, args))
    rows = []
    for (w, m), rs in runs.items():
        tok = [r["tok_s"] for r in rs]
        rows.append({"what": w, "mode": m, "tok_s": statistics.median(tok), "tok_s_all": sorted(round(t, 1) for t in tok)})
    det = {w: runs[(w, "deterministic")][0]["ids"] for w in whats if w != "prefill"}
    if "1" in det and "32" in det:
        assert det["32"][0] == det["1"][0], "deterministic inference: the first stream's tokens changed with 31 neighbours"
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, model {args.model or 'SmolLM2 (default)'}, "
          f"{args.prompt}+{args.new} tokens a stream, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'streams':>8} {'default tok/s':>14} {'deterministic':>14} {'ratio':>6}   rounds (default | deterministic)")
    for w in whats:
        d, x = (next(r for r in rows if r["what"] == w and r["mode"] == m) for m in MODES)
        name = f"prefill {args.prefill}" if w == "prefill" else w
        print(f"{name:>8} {d['tok_s']:>14.1f} {x['tok_s']:>14.1f} {x['tok_s'] / d['tok_s']:>6.2f}   "
              f"{d['tok_s_all']} | {x['tok_s_all']}")  # fmt: skip
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "deterministic.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
