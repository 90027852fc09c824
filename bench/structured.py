"""Constrained vs unconstrained generation on SmolLM2, side by side in one run: what the grammar
costs per step (the matcher's bitmask fill on the scheduler's side, the mask applied in the sampler).

    python bench/structured.py [--batch 16] [--max-new-tokens 64] [--rounds 3] [--dtype auto]

Both modes decode the same number of tokens (min_new_tokens = max_new_tokens keeps the stop tokens
masked; the grammar is letters, digits, spaces and punctuation), so the difference is the mask's
cost, not shorter answers. A third mode runs a real JSON schema and reports its own tokens/s. Rounds
alternate the modes so that the machine's noise hits each alike. Writes bench/out/structured.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENDLESS = r"root ::= [a-zA-Z0-9 ,.]+"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
}
PROMPT = "Describe a person called {} in JSON with their name, age and hobbies."
NAMES = ["Alice", "Bob", "Chen", "Dana", "Eve", "Farid", "Grace", "Hugo"]


def timed_masks():
    """Wrap GrammarState.masks to add up the time the scheduler spends filling bitmasks."""
    from kvledger.constrained.matcher import GrammarState

    spent = {"s": 0.0, "calls": 0}
    inner = GrammarState.masks

    def masks(self, drafts):
        t0 = time.perf_counter()
        try:
            return inner(self, drafts)
        finally:
            spent["s"] += time.perf_counter() - t0
            spent["calls"] += 1

    GrammarState.masks = masks
    return spent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from kvledger import Engine

    spent = timed_masks()
    eng = Engine(dtype=args.dtype)
    tok = eng.tokenizer
    prompts = []
    for i in range(args.batch):
        msgs = [{"role": "user", "content": PROMPT.format(NAMES[i % len(NAMES)])}]
        prompts.append(list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)))
    base = {"max_new_tokens": args.max_new_tokens, "temperature": 0.7, "seed": 1}
    # min_new_tokens = max_new_tokens masks the stop tokens (a complete grammar would allow EOS), so
    # both modes make exactly max_new_tokens tokens per request.
    same = {**base, "ignore_eos": True, "min_new_tokens": args.max_new_tokens}
    modes = {
        "free": same,
        "grammar (same length)": {**same, "ebnf": ENDLESS},
        "json_schema": {**base, "json_schema": json.dumps(SCHEMA)},
    }
    eng.generate(
        input_ids=prompts[:2], sampling_params={**modes["grammar (same length)"], "max_new_tokens": 4}
    )
    eng.generate(input_ids=prompts[:2], sampling_params={**modes["json_schema"], "max_new_tokens": 4})
    rates: dict[str, list[float]] = {m: [] for m in modes}
    mask_ms: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, sp in modes.items():
            spent.update(s=0.0, calls=0)
            eng.flush_cache()
            t0 = time.perf_counter()
            outs = eng.generate(input_ids=prompts, sampling_params=sp)
            dt = time.perf_counter() - t0
            n = sum(len(o["output_ids"]) for o in outs)
            rates[mode].append(n / dt)
            mask_ms[mode].append(1000 * spent["s"] / max(spent["calls"], 1))
    report = {
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "dtype": eng.core.info.dtype,
        "output_tok_s": {m: round(statistics.median(v), 1) for m, v in rates.items()},
        "mask_fill_ms_per_request_step": {m: round(statistics.median(v), 3) for m, v in mask_ms.items()},
    }
    free = report["output_tok_s"]["free"]
    report["grammar_vs_free"] = round(report["output_tok_s"]["grammar (same length)"] / free, 3)
    print(json.dumps(report, indent=2))
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "structured.json").write_text(json.dumps(report, indent=2))
    eng.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
