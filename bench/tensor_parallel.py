"""TP=1 vs TP=2 on this machine, side by side in one run, and what one all-reduce costs.

    python bench/tensor_parallel.py [--layers 12] [--batch 8] [--max-new-tokens 48]

SmolLM2's 9 attention heads do not split in two, so the model is a random Llama of the same family
(hidden 512, 8 heads, 4 KV heads, MLP 1536), built here. Every layer adds two all-reduces of
``[tokens, hidden]``; on one machine they go through shared memory (``parallel/comm.py: ShmComm``),
and the report gives both that and gloo's cost per all-reduce. Writes bench/out/tp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _allreduce_worker(rank: int, port: int, shape: tuple[int, int], iters: int, out, shm: str | None) -> None:
    from kvledger.parallel.comm import ShmComm, TPComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = ShmComm(rank, 2, shm, shape[0] * shape[1], create=False) if shm else TPComm(rank, 2)
    x = torch.randn(*shape)
    for _ in range(20):
        comm.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - t0) / iters)
    dist.destroy_process_group()


def allreduce_us(shape: tuple[int, int], iters: int = 300, shm: bool = False) -> float:
    """One all-reduce of ``shape`` floats between two processes: gloo, or kvledger's shared memory."""
    from kvledger.parallel.comm import ShmComm

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = None
    if shm:
        path = f"/dev/shm/kvledger-bench-{port}"
        ShmComm(0, 2, path, shape[0] * shape[1], create=True)
    q = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_allreduce_worker, args=(port, shape, iters, q, path), nprocs=2)
    finally:
        if path:
            os.unlink(path)
    return q.get() * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from tests.helpers import build_tiny_model

    from kvledger import Engine

    path = build_tiny_model(
        tempfile.mkdtemp(prefix="kvledger-tp-"), "llama", vocab_size=8192, hidden_size=512,
        intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64,
    )  # fmt: skip
    prompts = [[3 + i] * 16 + list(range(100, 164)) for i in range(args.batch)]
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    engines = {tp: Engine(model=path, dtype="float32", tp_size=tp, max_total_tokens=8192) for tp in (1, 2)}
    rates: dict[int, list[float]] = {1: [], 2: []}
    single: dict[int, list[float]] = {1: [], 2: []}
    outs = {}
    for _ in range(args.rounds):
        for tp, eng in engines.items():
            eng.flush_cache()
            t0 = time.perf_counter()
            res = eng.generate(input_ids=prompts, sampling_params=sp)
            rates[tp].append(args.batch * args.max_new_tokens / (time.perf_counter() - t0))
            outs[tp] = [r["output_ids"] for r in res]
            t0 = time.perf_counter()
            eng.generate(input_ids=prompts[0], sampling_params=sp)
            single[tp].append(args.max_new_tokens / (time.perf_counter() - t0))
    for eng in engines.values():
        eng.shutdown()
    report = {
        "model": f"random llama, {args.layers} layers, hidden 512, 8 heads / 4 KV, fp32",
        "cores": os.cpu_count(),
        "batch_output_tok_s": {f"tp{k}": round(statistics.median(v), 1) for k, v in rates.items()},
        "single_stream_tok_s": {f"tp{k}": round(statistics.median(v), 1) for k, v in single.items()},
        "tp2_equals_tp1": outs[1] == outs[2],
        "allreduce_us": {
            f"{kind} {name}": round(allreduce_us(shape, iters, shm=kind == "shm"), 1)
            for kind in ("gloo", "shm")
            for name, shape, iters in (
                ("decode [8, 512]", (args.batch, 512), 300),
                ("prefill [640, 512]", (640, 512), 100),
            )
        },
        "allreduces_per_forward": 2 * args.layers + 1,
    }
    print(json.dumps(report, indent=2))
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "tp.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
