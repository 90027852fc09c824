"""Single-stream speculative decoding (NGRAM, or STANDALONE) vs plain decoding, side by side in one run.

    python bench/spec_decode.py [--dtype auto] [--rounds 3] [--max-new-tokens 160]
    python bench/spec_decode.py --algorithm STANDALONE [--draft-model PATH]   # default draft: the target

Two workloads on SmolLM2 (chat template, greedy): "repeat this code with one change" (text that
repeats its prompt) and open prose questions (text that does not). The two engines alternate
request by request so that the machine's noise hits both alike. Reports output tok/s, verify steps,
tokens per verify step and the drafts' acceptance rate; writes JSON to bench/out/spec_decode.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CODE = """def parse_line(line):
    name, _, value = line.partition("=")
    return name.strip(), value.strip()


def load_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, value = parse_line(line)
                config[name] = value
    return config
"""
REPEAT = [
    f"Repeat this Python code exactly, but rename the function load_config to {n}. Output only code.\n\n{CODE}"
    for n in ("read_config", "load_settings", "parse_config_file")
]
PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "What are three good habits for learning a new language? Explain each.",
]


def run(eng, tok, prompts: list[str], n: int) -> dict:
    out_tokens = verify = 0
    t = 0.0
    texts = []
    for p in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
        )
        t0 = time.perf_counter()
        o = eng.generate(input_ids=list(ids), sampling_params={"max_new_tokens": n, "temperature": 0})
        t += time.perf_counter() - t0
        out_tokens += len(o["output_ids"])
        verify += o["meta_info"].get("spec_verify_ct", 0)
        texts.append(o["output_ids"])
    return {
        "output_tokens": out_tokens,
        "seconds": t,
        "tok_s": out_tokens / t,
        "verify_steps": verify,
        "ids": texts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--algorithm", default="NGRAM", choices=["NGRAM", "STANDALONE"])
    ap.add_argument(
        "--draft-model", default=None, help="STANDALONE: the draft model (default: the target itself)"
    )
    ap.add_argument("--out", default="bench/out/spec_decode.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from kvledger import Engine
    from kvledger.model import load_model

    loaded = load_model(None)
    kw = dict(dtype=args.dtype, page_size=16, max_total_tokens=16384)
    engines = {
        "plain": Engine(loaded_model=loaded, **kw),
        "spec": Engine(
            loaded_model=loaded,
            speculative_algorithm=args.algorithm,
            speculative_draft_model_path=args.draft_model
            or (loaded.path if args.algorithm == "STANDALONE" else None),
            speculative_num_draft_tokens=args.num_draft_tokens,
            **kw,
        ),
    }
    tok = engines["plain"].tokenizer
    for e in engines.values():  # warm-up
        e.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
    report: dict = {"args": vars(args), "workloads": {}}
    for name, prompts in (("repeat_code", REPEAT), ("prose", PROSE)):
        acc = {k: {"output_tokens": 0, "seconds": 0.0, "verify_steps": 0} for k in engines}
        totals = engines["spec"].core.scheduler.spec_totals
        drafted0, accepted0 = totals.drafted, totals.accepted
        same = total = 0
        for _ in range(args.rounds):
            res = {}
            for k, e in engines.items():
                e.flush_cache()  # no prefix-cache advantage between rounds
                res[k] = run(e, tok, prompts, args.max_new_tokens)
                for f in acc[k]:
                    acc[k][f] += res[k][f]
            same += sum(a == b for a, b in zip(res["plain"]["ids"], res["spec"]["ids"]))
            total += len(prompts)
        rows = {}
        for k, a in acc.items():
            rows[k] = {
                "tok_s": round(a["output_tokens"] / a["seconds"], 1),
                "output_tokens": a["output_tokens"],
            }
            if a["verify_steps"]:
                rows[k]["verify_steps"] = a["verify_steps"]
        drafted, accepted = totals.drafted - drafted0, totals.accepted - accepted0
        rows["spec"]["draft_acceptance"] = round(accepted / max(drafted, 1), 3)
        rows["spec"]["tokens_per_verify"] = round((accepted + rows["spec"].get("verify_steps", 0))
                                                   / max(rows["spec"].get("verify_steps", 1), 1), 2)  # fmt: skip
        rows["speedup"] = round(rows["spec"]["tok_s"] / rows["plain"]["tok_s"], 2)
        rows["identical_outputs"] = f"{same}/{total}"
        report["workloads"][name] = rows
        print(name, json.dumps(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
