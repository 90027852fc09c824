"""Offline benchmark of kvledger against transformers on the same weights, side by side in one run.

    python bench/offline.py [--dtype bfloat16] [--requests 64] [--quick]

Measures: load time; single-stream prefill and decode tok/s (128-token prompt, 128 new tokens);
batched output tok/s for N requests of 128 prompt / 128 output tokens (transformers: padded static
``generate`` in batches of 32); and the same with a 512-token shared system prompt, prefix cache on/off.
Writes JSON to bench/out/offline.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
log = logging.getLogger("bench")


def prompts(n: int, length: int, seed: int, vocab: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    body = length - len(prefix or [])
    return [(prefix or []) + [rng.randrange(100, vocab - 100) for _ in range(body)] for _ in range(n)]


def bench_kvledger(args, loaded, results: dict) -> None:
    from kvledger import Engine

    kw = dict(
        dtype=args.dtype,
        page_size=16,
        max_total_tokens=args.kv_tokens,
        chunked_prefill_size=512,
        max_running_requests=64,
        quantization=args.quantization,
        enable_torch_compile=args.compile,
    )
    eng = Engine(loaded_model=loaded, **kw)
    vocab = eng.core.limits.vocab_size
    gen = {"max_new_tokens": args.out_len, "temperature": 0, "ignore_eos": True}
    # warm-up
    eng.generate(input_ids=prompts(1, 16, 99, vocab)[0], sampling_params={**gen, "max_new_tokens": 4})
    p = prompts(1, args.in_len, 1, vocab)[0]
    t0 = time.perf_counter()
    eng.generate(input_ids=p, sampling_params={**gen, "max_new_tokens": 1})
    t_prefill = time.perf_counter() - t0
    eng.flush_cache()
    t0 = time.perf_counter()
    eng.generate(input_ids=p, sampling_params=gen)
    t_all = time.perf_counter() - t0
    eng.flush_cache()
    results["kvledger"] = {
        "prefill_tok_s": args.in_len / t_prefill,
        "decode_tok_s": (args.out_len - 1) / max(t_all - t_prefill, 1e-9),
    }
    batch = prompts(args.requests, args.in_len, 2, vocab)
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=batch, sampling_params=gen)
    dt = time.perf_counter() - t0
    results["kvledger"]["batch_output_tok_s"] = sum(len(o["output_ids"]) for o in outs) / dt
    eng.flush_cache()
    sys_prompt = prompts(1, 512, 3, vocab)[0]
    shared = prompts(args.requests, 512 + args.in_len, 4, vocab, prefix=sys_prompt)
    for cache in (True, False):
        e2 = Engine(loaded_model=loaded, enable_prefix_cache=cache, **kw)
        e2.generate(
            input_ids=[*sys_prompt, 5], sampling_params={**gen, "max_new_tokens": 1}
        )  # warm the prefix
        t0 = time.perf_counter()
        outs = e2.generate(input_ids=shared, sampling_params=gen)
        dt = time.perf_counter() - t0
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        results["kvledger"][f"shared_prefix_{'cache' if cache else 'nocache'}_output_tok_s"] = (
            sum(len(o["output_ids"]) for o in outs) / dt
        )
        results["kvledger"][f"shared_prefix_{'cache' if cache else 'nocache'}_cached_tokens"] = cached
        e2.shutdown()
    m = eng.memory()
    results["kvledger"]["kv_total_tokens"] = m["kv_total"]


def bench_transformers(args, results: dict) -> None:
    import transformers

    from kvledger.model.loader import default_model_path

    path = default_model_path()
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
    ).eval()
    results["transformers"] = {"load_s": time.perf_counter() - t0}
    vocab = model.config.vocab_size

    def gen(batch: list[list[int]], n: int) -> float:
        ids = torch.tensor(batch)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t

    gen(prompts(1, 16, 99, vocab), 4)
    p = prompts(1, args.in_len, 1, vocab)
    t_prefill = gen(p, 1)
    t_all = gen(p, args.out_len)
    results["transformers"]["prefill_tok_s"] = args.in_len / t_prefill
    results["transformers"]["decode_tok_s"] = (args.out_len - 1) / (t_all - t_prefill)
    batch = prompts(args.requests, args.in_len, 2, vocab)
    dt = 0.0
    for i in tqdm(range(0, len(batch), 32), desc="transformers padded batches"):
        dt += gen(batch[i : i + 32], args.out_len)
    results["transformers"]["batch_output_tok_s"] = len(batch) * args.out_len / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--quantization", default=None, choices=["int8"])
    ap.add_argument("--compile", action="store_true", help="kvledger with --enable-torch-compile")
    ap.add_argument("--out", default="bench/out/offline.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from kvledger.model import load_model

    results: dict = {"args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    loaded = load_model(None)
    results["kvledger_load_s"] = time.perf_counter() - t0
    log.info("kvledger loaded in %.1fs", results["kvledger_load_s"])
    bench_kvledger(args, loaded, results)
    log.info("kvledger: %s", results["kvledger"])
    if not args.skip_transformers:
        import transformers

        results["transformers_version"] = transformers.__version__
        bench_transformers(args, results)
        log.info("transformers: %s", results["transformers"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
