"""TP=1 vs TP=2 on this machine, side by side in one run, and what one all-reduce costs.

    python bench/tensor_parallel.py [--layers 12] [--batch 8] [--max-new-tokens 48]
    python bench/tensor_parallel.py --draft   # STANDALONE drafts under TP: where the draft runs

SmolLM2's 9 attention heads do not split in two, so the model is a random Llama of the same family
(hidden 512, 8 heads, 4 KV heads, MLP 1536), built here. Every layer adds two all-reduces of
``[tokens, hidden]``; on one machine they go through shared memory (``comm.py: ShmComm``),
and the report gives both that and gloo's cost per all-reduce. Writes bench/out/tp.json.

``--draft`` measures a draft model under TP instead (bench/out/tp_draft.json). The target's layers
past the second are made weak (their O and down projections scaled by 0.05), so a 2-layer draft cut
from it (the same embedding, first two layers and head) agrees with it often, as a real draft does.
It reports (1) one draft forward (a single-stream decode of the draft alone) where it could run:
rank 0 with its share of the cores (what kvledger does), rank 0 with every core, and sharded over
both ranks like the target (TP=2, shared-memory collectives); (2) the target with and without the
draft, TP=1 and TP=2, single stream and a batch, with the tokens drafted and accepted.
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
    from kvledger.comm import ShmComm, TPComm

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
    from kvledger.comm import ShmComm

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


def build_target(layers: int) -> str:
    from tests.helpers import build_tiny_model

    return build_tiny_model(
        tempfile.mkdtemp(prefix="kvledger-tp-"), "llama", vocab_size=8192, hidden_size=512,
        intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64,
    )  # fmt: skip


def build_draft_pair(layers: int, draft_layers: int = 2) -> tuple[str, str]:
    """A target whose layers past ``draft_layers`` barely move the residual stream, and the draft cut
    from its first ``draft_layers`` (same embedding, norm and head): a draft that often agrees."""
    import transformers

    target = build_target(layers)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(target)
    model.config.num_hidden_layers = draft_layers
    model.model.layers = model.model.layers[:draft_layers]
    draft = tempfile.mkdtemp(prefix="kvledger-tp-draft-")
    model.save_pretrained(draft)
    return target, draft


def tok_s(eng, prompts, sp, rounds: int) -> float:
    """Median output tok/s of ``prompts`` (a list of prompts, or one), prefix cache flushed first."""
    n = len(prompts) if isinstance(prompts[0], list) else 1
    rates = []
    for _ in range(rounds):
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=sp)
        rates.append(n * sp["max_new_tokens"] / (time.perf_counter() - t0))
    return round(statistics.median(rates), 1)


def draft_report(args) -> dict:
    from kvledger import Engine

    target, draft = build_draft_pair(args.layers)
    cores = os.cpu_count() or 1
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    prompt = [3] * 16 + list(range(100, 164))
    # (1) One draft forward, where it could run: the draft served alone, single stream.
    placements = {
        f"rank 0, its share of the cores ({max(1, cores // 2)} threads)": dict(tp_size=1, num_threads=max(1, cores // 2)),
        f"rank 0, every core ({cores} threads)": dict(tp_size=1, num_threads=cores),
        "sharded over 2 ranks like the target": dict(tp_size=2),
    }  # fmt: skip
    per_forward = {}
    for name, kw in placements.items():
        eng = Engine(model=draft, dtype="float32", max_total_tokens=4096, **kw)
        tok_s(eng, prompt, {**sp, "max_new_tokens": 8}, 1)  # warm
        per_forward[name] = round(1000 / tok_s(eng, prompt, sp, args.rounds), 2)
        eng.shutdown()
    # (2) The target with and without the draft (on rank 0), TP=1 and TP=2.
    batch = [[3 + i] * 16 + list(range(100, 164)) for i in range(args.batch)]
    end_to_end = {}
    spec = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": draft}
    for tp in (1, 2):
        for name, kw in (("plain", {}), ("draft", spec)):
            eng = Engine(model=target, dtype="float32", tp_size=tp, max_total_tokens=8192, **kw)
            tok_s(eng, prompt, {**sp, "max_new_tokens": 8}, 1)
            row = {"single_stream_tok_s": tok_s(eng, prompt, sp, args.rounds),
                   f"batch_{args.batch}_tok_s": tok_s(eng, batch, sp, args.rounds)}  # fmt: skip
            if eng.core.scheduler.proposer is not None:
                t = eng.core.scheduler.spec_totals
                row["accepted_fraction"] = round(t.accepted / max(t.drafted, 1), 3)
            end_to_end[f"tp{tp} {name}"] = row
            eng.shutdown()
    return {
        "target": f"random llama, {args.layers} layers (past the 2nd weakened), hidden 512, fp32",
        "draft": "its first 2 layers, same embedding and head",
        "cores": cores,
        "draft_forward_ms": per_forward,
        "target_tok_s": end_to_end,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft", action="store_true", help="measure a draft model under TP instead")
    args = ap.parse_args()
    from kvledger import Engine

    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    if args.draft:
        report = draft_report(args)
        print(json.dumps(report, indent=2))
        (out / "tp_draft.json").write_text(json.dumps(report, indent=2))
        return 0
    path = build_target(args.layers)
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
    (out / "tp.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
