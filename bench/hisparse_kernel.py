"""HiSparse's CPU kernel alone: ``hisparse_select`` and ``hisparse_attention`` over 30 layers at SmolLM2's
shapes (3 KV heads x 3 query heads, head_dim 64, page 16, bf16 host pool), random K/V, one thread.

    python bench/hisparse_kernel.py [--contexts 8192] [--rows 1,8] [--top-k 64] [--iters 10]

Prints ms per step (all 30 layers) for the selection alone and selection + attention, at ``--top-k``
and with every page read (top-k -1: what a dense layer costs through the same kernel).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvledger import kernels

L, KVH, G, D, PS = 30, 3, 3, 64, 16


def timed(f, n: int) -> float:
    """ms per call of f, over n calls after one warm-up."""
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def case(ctx: int, rows: int, top_k: int, iters: int, select_only: bool) -> str:
    """One line: rows sequences of ctx tokens, each with its own consecutive host pages."""
    op = torch.ops.kvledger_cpu
    pages = ctx // PS + 1
    host = rows * pages + 2
    host_k = torch.randn(host, L, KVH, PS, D).to(torch.bfloat16)
    host_v = torch.randn(host, L, KVH, PS, D).to(torch.bfloat16)
    # [layers, host pages, KVH, 2, D] in the pool's dtype (model/hisparse.py's layout)
    summary = torch.stack([host_k.amin(3), host_k.amax(3)], 3).transpose(0, 1).contiguous()
    table = torch.arange(rows * pages).view(rows, pages).contiguous()
    lens = torch.full((rows,), ctx, dtype=torch.int64)
    q = torch.randn(rows, KVH * G, D).to(torch.bfloat16)
    kn = torch.randn(rows, KVH, D).to(torch.bfloat16)
    vn = torch.randn(rows, KVH, D).to(torch.bfloat16)
    pool = (host_k, host_v, summary)
    sel = timed(lambda: [op.hisparse_select(q, kn, vn, *pool, layer, table, lens, 1, 2, top_k) for layer in range(L)],
                iters)
    line = f"ctx {ctx} rows {rows} top_k {top_k}: select {sel:.2f} ms / {L} layers"
    if not select_only:
        att = timed(lambda: [op.hisparse_attention(q, kn, vn, *pool, layer, table, lens, 1, 2, top_k, 0.125)
                             for layer in range(L)], iters)
        line += f", select+attention {att:.2f} ms"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--select-only", action="store_true", help="time the selection only")
    ap.add_argument("--no-dense", action="store_true", help="skip the top-k -1 (every page) rows")
    args = ap.parse_args()
    assert kernels.load(), "the CPU kernels did not load"
    kernels.set_threads(1)
    torch.manual_seed(0)
    for ctx in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            for top_k in (args.top_k,) if args.no_dense else (args.top_k, -1):
                print(case(ctx, rows, top_k, args.iters, args.select_only), flush=True)


if __name__ == "__main__":
    main()
