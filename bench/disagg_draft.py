"""PD with a draft model: recompute the draft's prompt K/V on decode, or move it with the target's?
What each costs per prompt of P tokens, on this machine.

    python bench/disagg_draft.py [--dtype float32] [--prompt 1024] [--draft-layers 4] [--reps 3] [--threads 1]

Decode receives the target's prompt K/V by transfer; the draft model's must be there too before it
drafts. kvledger recomputes it on decode (the draft's first proposal after the admission runs it from
position 0, as after any admission). The alternative moves it: prefill runs the same draft forward
over the prompt (it drafts nothing itself) and the transfer carries a second layout. Rows, per prompt
length (the fastest of ``reps``):

- target prefill: what PD takes off decode;
- draft recompute: the draft's forward over the prompt, on decode's engine thread (the choice), and
  per 1,000 prompt tokens;
- draft K/V bytes: what moving it would add to the transfer (the target's bytes beside them), and
  that at the built-in transport's measured ~1.2 GB/s on loopback (bench/RESULTS.md, PD section).

Target: SmolLM2-135M (30 layers). Draft: a random model of SmolLM2's width and vocabulary with
``--draft-layers`` layers (timing only). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from hicache_draft import best_ms, target_and_draft  # noqa: E402

from kvledger.memory import KVBuffer  # noqa: E402
from kvledger.model import LlamaModel  # noqa: E402
from kvledger.spec.draft_model import DraftModelProposer  # noqa: E402

LOOPBACK_BYTES_S = 1.2e9  # the built-in transport at 1,024 tokens (bench/RESULTS.md)


def prefill_ms(model: LlamaModel, p: int, page_size: int, reps: int) -> float:
    """The forward over ``p`` tokens from position 0 (the draft's recompute, or the target's prefill)."""
    runner = DraftModelProposer(model, p, page_size, 1)  # a model over its own KV buffer
    row = torch.arange(p).reshape(1, -1)
    ids = [(7 + 13 * i) % model.cfg.vocab_size for i in range(p)]
    return best_ms(lambda: runner._forward(ids, 0, row), reps)


def kv_bytes(model: LlamaModel) -> int:
    mc = model.cfg
    return KVBuffer.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, model.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", type=int, nargs="+", default=[1024])
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    t_loaded, target, draft = target_and_draft(dtype, args.draft_layers)
    tb, db = kv_bytes(target), kv_bytes(draft)
    print(f"target {t_loaded.config.name} ({t_loaded.config.num_layers} layers, {tb:,} B/token of KV), draft "
          f"{args.draft_layers} layers of its width ({db:,} B/token), {args.dtype}, {torch.get_num_threads()} "
          "threads\n")  # fmt: skip
    print("| prompt | target prefill | draft recompute on decode | per 1k tokens | target KV moved | "
          "draft KV it would add | at ~1.2 GB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for p in args.prompt:
        tf = prefill_ms(target, p, args.page_size, args.reps)
        df = prefill_ms(draft, p, args.page_size, args.reps)
        print(f"| {p} | {tf:.0f} ms | {df:.0f} ms ({df / tf:.0%} of prefill) | {df * 1000 / p:.0f} ms | "
              f"{tb * p / 2**20:.1f} MiB | +{db * p / 2**20:.1f} MiB (+{db / tb:.0%}) | "
              f"+{db * p / LOOPBACK_BYTES_S * 1e3:.1f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
