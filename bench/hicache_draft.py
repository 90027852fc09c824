"""Should a draft model's K/V move between the tiers with its page? What each choice costs per
loaded-back prefix of P tokens, on this machine.

    python bench/hicache_draft.py [--dtype float32] [--prefix 512 2048] [--draft-layers 4] [--reps 5] [--threads 1]

With the hierarchy a prefix comes back from L2 (or L3) instead of being recomputed by the target.
The draft model then either recomputes its K/V of the prefix (what kvledger does: after every
admission it runs the sequence from position 0) or, had its K/V moved with the page, would copy it
back like the target's. Rows, per prefix length (the fastest of ``reps``: on a shared machine the
others measure the neighbours):

- target prefill: what the load-back saves;
- target load-back: the L2 -> L1 copy that replaces it;
- draft recompute: the draft's forward over the prefix (kvledger's choice);
- draft K/V copy: what moving the draft's K/V back would cost instead;
- and the L2/L3 bytes a page would grow by, carrying the draft's K/V too.

Target: SmolLM2-135M (30 layers). Draft: a random model of SmolLM2's width and vocabulary with
``--draft-layers`` layers (timing only; weights do not change the cost). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvledger.hicache.host_pool import HostKV  # noqa: E402
from kvledger.model import LlamaModel, load_model  # noqa: E402
from kvledger.spec.draft_model import DraftModelProposer  # noqa: E402


def random_draft(path: str, target_cfg, layers: int) -> str:
    import transformers

    c = target_cfg
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def best_ms(fn, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times)


def costs(model: LlamaModel, p: int, page_size: int, reps: int) -> tuple[float, float, int]:
    """(forward over ``p`` tokens from position 0, L2 -> L1 copy of ``p`` tokens, K/V bytes a page)."""
    runner = DraftModelProposer(model, p, page_size, 1)  # a model over its own KV buffer
    row = torch.arange(p).reshape(1, -1)
    ids = [(7 + 13 * i) % model.cfg.vocab_size for i in range(p)]
    fwd = best_ms(lambda: runner._forward(ids, 0, row), reps)
    mc = model.cfg
    host = HostKV(p // page_size, page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, model.dtype)
    pages = list(range(p // page_size))
    host.save(runner.kv_buffer, pages, pages)
    copy = best_ms(lambda: host.load(runner.kv_buffer, pages, pages), reps)
    return fwd, copy, host.page_bytes


def target_and_draft(dtype: torch.dtype, draft_layers: int):
    """SmolLM2 (the default model) and a random draft of ``draft_layers`` layers of its width, as
    ``LlamaModel``s; returns ``(target's LoadedModel, target, draft)``."""
    t_loaded = load_model(None, load_tokenizer=False)
    target = LlamaModel(t_loaded.config, dict(t_loaded.weights), dtype=dtype)
    with tempfile.TemporaryDirectory() as d:
        d_loaded = load_model(random_draft(d, t_loaded.config, draft_layers), load_tokenizer=False)
        draft = LlamaModel(d_loaded.config, dict(d_loaded.weights), dtype=dtype)
    return t_loaded, target, draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prefix", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    t_loaded, target, draft = target_and_draft(dtype, args.draft_layers)
    print(f"target {t_loaded.config.name} ({t_loaded.config.num_layers} layers), draft {args.draft_layers} "
          f"layers of its width, {args.dtype}, page size {args.page_size}, {torch.get_num_threads()} threads\n")  # fmt: skip
    print("| prefix | target prefill | target load-back | draft recompute | draft K/V copy | page bytes + draft |")
    print("|---|---|---|---|---|---|")
    for p in args.prefix:
        tf, tc, tb = costs(target, p, args.page_size, args.reps)
        df, dc, db = costs(draft, p, args.page_size, args.reps)
        print(f"| {p} | {tf:.0f} ms | {tc:.1f} ms | {df:.0f} ms ({df / tf:.0%} of prefill) | {dc:.1f} ms | "
              f"+{db / tb:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
