"""How close the default quantized mode is to the GGUF's own weights, dequantized and run in fp32.

    python bench/quant_agreement.py [--model M.gguf] [--chat-template NAME] [--prompts 50] \
        [--max-new-tokens 32] [--first 16] [--quantization auto] [--enable-int8-batch] \
        [--kv-cache-dtype fp8_e4m3] [--batch] [--llama-server PATH]

The reference is ``--dtype float32`` (token-exact with transformers on the dequantized file, see
tests/unit/test_model_parity.py); the candidate is the default (``--dtype auto --quantization auto``:
bf16 with int4 Q4_1 layers and the int8 Q8_0 head on SmolLM2). One request at a time, so every
decode step runs the quantized kernels (forwards of <= 4 rows); ``--batch`` runs the candidate's
prompts all at once instead (batched decodes: with ``--enable-int8-batch`` those of
``linear.INT8_VNNI_ROWS`` rows and more take the int8 copies on a CPU with VNNI and no AMX).
Reports: greedy outputs identical,
mean tokens matched before the first difference, the share of prompts whose first ``--first`` tokens
agree, and the mean |logprob delta| of the chosen token over the matched positions (both engines
scored the same token there). A file without a chat template (Gemma 3 270M) takes ``--chat-template``
(kvledger's setting: a built-in name or a Jinja file).

With ``--llama-server``, llama.cpp runs the same prompt tokens on the same file (greedy, one at a
time, ``/completion`` with the token ids) and is scored against the same fp32 reference, and the
default is compared with it directly (outputs identical, tokens matched).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).parent))  # bench/compare.py's server helpers

import httpx

from kvledger import Engine
from kvledger.model import load_model
from kvledger.model.loader import default_model_path

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


def chat_ids(eng: Engine, texts: list[str]) -> list[list[int]]:
    tok = eng.tokenizer
    ids = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts
    ]
    return [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]


def run(eng: Engine, ids: list[list[int]], max_new: int, batch: bool = False) -> list[dict]:
    """Each prompt's greedy output with logprobs: one at a time, or (``batch``) all in one call, so
    that decode steps run every prompt together (batched forwards: ``--enable-int8-batch``'s path)."""
    params = {"max_new_tokens": max_new, "temperature": 0, "logprobs": True}
    if batch:
        return eng.generate(input_ids=ids, sampling_params=params)
    return [eng.generate(input_ids=i, sampling_params=params) for i in tqdm(ids)]


def llama_cpp(binary: str, model: str, ids: list[list[int]], max_new: int) -> tuple[str, list[dict]]:
    """llama-server's greedy continuation of each prompt, in kvledger's output shape."""
    from compare import System, free_port, start, stop

    out_dir = Path(__file__).parent / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    v = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    version = " ".join((v.stdout + v.stderr).strip().splitlines()[:2])
    cmd = [binary, "-m", model, "--port", "{port}", "--host", "127.0.0.1", "-np", "1", "-c", "4096"]
    srv = start(System("llama-server-agreement", cmd, version), free_port(), out_dir)
    if isinstance(srv, str):
        raise SystemExit(f"llama-server did not start: {srv}")
    outs = []
    try:
        with httpx.Client(timeout=120) as c:
            for prompt in tqdm(ids):
                body = {
                    "prompt": prompt,  # token ids: no BOS or template added
                    "n_predict": max_new,
                    "temperature": 0.0,  # greedy
                    "n_probs": 1,
                    "cache_prompt": False,
                    "return_tokens": True,
                }
                r = c.post(srv.url + "/completion", json=body)
                r.raise_for_status()
                d = r.json()
                probs = d.get("completion_probabilities") or []
                toks = d.get("tokens") or [p["id"] for p in probs]
                lps = [p.get("logprob", math.log(max(p.get("prob", 0.0), 1e-30))) for p in probs]
                outs.append(
                    {
                        "output_ids": toks,
                        "meta_info": {"output_token_logprobs": [(lp, t) for lp, t in zip(lps, toks)]},
                    }
                )
    finally:
        stop(srv)
    return f"llama-server {version}: the file as llama.cpp runs it", outs


def agreement(ref: list[dict], cand: list[dict], first: int = 16) -> dict:
    """Identical outputs, tokens matched before the first difference, the share agreeing on their
    first ``first`` tokens (or on all of a shorter reference), |logprob delta| there."""
    same, matched, deltas = 0, [], []
    for a, b in zip(ref, cand):
        ia, ib = a["output_ids"], b["output_ids"]
        n = next((i for i, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
        same += ia == ib
        matched.append(n)
        la = a["meta_info"]["output_token_logprobs"]
        lb = b["meta_info"]["output_token_logprobs"]
        deltas += [abs(la[i][0] - lb[i][0]) for i in range(min(n, len(la), len(lb)))]
    return {
        "identical": same,
        "mean_tokens_matched": statistics.mean(matched),
        "tokens_matched": matched,  # each prompt's, in order
        "first_token_agreement": sum(m > 0 for m in matched) / len(matched),
        f"first_{first}_tokens_agreement": sum(
            m >= min(first, len(a["output_ids"])) for m, a in zip(matched, ref)
        ) / len(matched),
        "mean_abs_logprob_delta": statistics.mean(deltas) if deltas else None,
        "p95_abs_logprob_delta": sorted(deltas)[int(0.95 * (len(deltas) - 1))] if deltas else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--first", type=int, default=16, help="report the share agreeing on this many first tokens")
    p.add_argument("--chat-template", default=None, help="kvledger's --chat-template (a file without one)")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--enable-int8-batch", action="store_true", help="the candidate with --enable-int8-batch")
    p.add_argument("--kv-cache-dtype", default="auto", help="the candidate's KV pool (fp8_e4m3: float8)")
    p.add_argument(
        "--batch", action="store_true", help="the candidate runs every prompt at once (batched decodes)"
    )
    p.add_argument(
        "--llama-server", default=None, help="also compare llama.cpp's output (a llama-server binary)"
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "out" / "quant_agreement.json"))
    args = p.parse_args()
    texts = prompts(args.prompts)
    outs = {}
    ids: list[list[int]] = []
    for name, kw in (
        ("fp32", {"dtype": "float32"}),
        ("default", {"quantization": args.quantization, "enable_int8_batch": args.enable_int8_batch,
                     "kv_cache_dtype": args.kv_cache_dtype}),
    ):
        eng = Engine(loaded_model=load_model(args.model), max_total_tokens=16384, chat_template=args.chat_template, **kw)
        label = f"{name}: {eng.core.info.dtype}, attention {eng.core.model.attention}"
        label += ", int8 batch" if eng.core.cfg.kernels.enable_int8_batch else ""
        label += f", KV {eng.core.cfg.cache.kv_cache_dtype}" if eng.core.cfg.cache.kv_cache_dtype != "auto" else ""
        print(label)
        ids = ids or chat_ids(eng, texts)
        batch = args.batch and name == "default"
        label += f", all {len(ids)} prompts at once" if batch else ""
        outs[name] = (label, run(eng, ids, args.max_new_tokens, batch))
        eng.shutdown()
    report = {
        "reference": outs["fp32"][0],
        "candidate": outs["default"][0],
        "prompts": len(texts),
        "max_new_tokens": args.max_new_tokens,
        "model": args.model or default_model_path(),
        "chat_template": args.chat_template,
        **agreement(outs["fp32"][1], outs["default"][1], args.first),
    }
    if args.llama_server:
        label, lc = llama_cpp(args.llama_server, args.model or default_model_path(), ids, args.max_new_tokens)
        report["llama_cpp"] = {"system": label, "vs_reference": agreement(outs["fp32"][1], lc, args.first)}
        report["llama_cpp"]["default_vs_llama_cpp"] = agreement(lc, outs["default"][1], args.first)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
