"""Mixed chunks on vs off, side by side: N requests arriving in waves while others decode.

python bench/mixed_chunk.py [--requests 48] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from kvledger import Engine
from kvledger.model import load_model


def run(loaded, mixed: bool, args) -> dict:
    eng = Engine(
        loaded_model=loaded,
        dtype=args.dtype,
        page_size=16,
        max_total_tokens=65536,
        chunked_prefill_size=256,
        enable_mixed_chunk=mixed,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(args.requests)]
    sp = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    eng.generate(input_ids=prompts[0][:8], sampling_params={**sp, "max_new_tokens": 2})
    t0 = time.perf_counter()
    rids, first, pending = [], {}, list(prompts)
    while pending or not eng.core.scheduler.idle:
        # Arrivals: a wave of 8 new requests whenever fewer than 8 are running, so prefills keep
        # landing while others decode (the case mixed chunks are for).
        if pending and len(eng.core.scheduler.running) < 8:
            for _ in range(min(8, len(pending))):
                rids.append(eng.add_request(pending.pop(0), sp))
        eng.step()
        for r in rids:
            req = eng.core.scheduler.reqs.get(r)
            if r not in first and req is not None and req.output_ids:
                first[r] = time.perf_counter() - t0
    dt = time.perf_counter() - t0
    outs = [eng.result(r) for r in rids]
    tokens = sum(len(o["output_ids"]) for o in outs if o)
    ttft = sorted(first.values())
    return {"mixed": mixed, "output_tok_s": tokens / dt, "wall_s": dt, "ttft_p50_s": ttft[len(ttft) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    loaded = load_model(None)
    print(json.dumps([run(loaded, m, args) for m in (True, False, True, False)], indent=2))


if __name__ == "__main__":
    main()
