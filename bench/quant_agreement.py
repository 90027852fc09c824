"""How close the default quantized mode is to the GGUF's own weights, dequantized and run in fp32.

    python bench/quant_agreement.py [--prompts 50] [--max-new-tokens 32] [--quantization auto]

The reference is ``--dtype float32`` (token-exact with transformers on the dequantized file, see
tests/unit/test_model_parity.py); the candidate is the default (``--dtype auto --quantization auto``:
bf16 with int4 Q4_1 layers and the int8 Q8_0 head on SmolLM2). One request at a time, so every
decode step runs the quantized kernels (forwards of <= 4 rows). Reports: greedy outputs identical,
mean tokens matched before the first difference, and the mean |logprob delta| of the chosen token
over the matched positions (both engines scored the same token there).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tqdm.auto import tqdm

from kvledger import Engine
from kvledger.model import load_model

TOPICS = [
    *("the ocean", "a volcano", "bread", "the moon", "chess", "rain", "a library", "bicycles", "coffee"),
    *("winter", "honeybees", "a lighthouse", "trains", "music", "gardening", "the desert", "mathematics"),
    *("clocks", "friendship", "a museum", "mountains", "electricity", "a river", "the internet", "birds"),
    *("cooking pasta", "a city at night", "photography", "glaciers", "running", "a market", "the sun"),
    *("snow", "forests", "bridges", "robots", "tea", "maps", "a storm", "history", "painting", "the brain"),
    *("soccer", "islands", "letters", "wind", "stars", "a farm", "kites", "salt"),
]
FORMS = ("Write one sentence about {}.", "Explain {} to a child.", "Give three facts about {}.")


def prompts(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]


def run(eng: Engine, texts: list[str], max_new: int) -> list[dict]:
    params = {"max_new_tokens": max_new, "temperature": 0, "logprobs": True}
    tok = eng.tokenizer
    ids = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts
    ]
    ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
    return [eng.generate(input_ids=i, sampling_params=params) for i in tqdm(ids)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--enable-int8-batch", action="store_true", help="the candidate with --enable-int8-batch")
    p.add_argument("--out", default=str(Path(__file__).parent / "out" / "quant_agreement.json"))
    args = p.parse_args()
    texts = prompts(args.prompts)
    outs = {}
    for name, kw in (
        ("fp32", {"dtype": "float32"}),
        ("default", {"quantization": args.quantization, "enable_int8_batch": args.enable_int8_batch}),
    ):
        eng = Engine(loaded_model=load_model(args.model), max_total_tokens=16384, **kw)
        label = f"{name}: {eng.core.info.dtype}, attention {eng.core.model.attention}"
        label += ", int8 batch" if eng.core.cfg.enable_int8_batch else ""
        print(label)
        outs[name] = (label, run(eng, texts, args.max_new_tokens))
        eng.shutdown()
    same, matched, deltas = 0, [], []
    for a, b in zip(outs["fp32"][1], outs["default"][1]):
        ia, ib = a["output_ids"], b["output_ids"]
        n = next((i for i, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
        same += ia == ib
        matched.append(n)
        la = a["meta_info"]["output_token_logprobs"]
        lb = b["meta_info"]["output_token_logprobs"]
        deltas += [abs(la[i][0] - lb[i][0]) for i in range(n)]
    report = {
        "reference": outs["fp32"][0],
        "candidate": outs["default"][0],
        "prompts": len(texts),
        "max_new_tokens": args.max_new_tokens,
        "identical": same,
        "mean_tokens_matched": statistics.mean(matched),
        "first_token_agreement": sum(m > 0 for m in matched) / len(matched),
        "mean_abs_logprob_delta": statistics.mean(deltas) if deltas else None,
        "p95_abs_logprob_delta": sorted(deltas)[int(0.95 * (len(deltas) - 1))] if deltas else None,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
