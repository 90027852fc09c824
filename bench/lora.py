"""Multi-LoRA on the CPU (issue 34 item 4): two measurements.

``--kernels``: the adapters' deltas of one forward over SmolLM2-135M's projection shapes (30 layers
of QKV, O, gate/up, down), 32 rows from 4 adapters, three ways: *kvledger* (``model/lora.py``: the
present adapters' A side by side, each row masked to its own columns, their Bs side by side: two
matmuls per projection), *grouped* (each adapter's rows gathered, two matmuls per adapter, added
back), *bmm* (SGMV's shape: every row's A and B gathered, two batched matmuls). Rows interleaved as
a scheduler's decodes come (r0 a0, r1 a1, ...) and sorted by adapter. Best of ``--reps``.

Default: tokens per second of a batch of decodes on the SmolLM2 GGUF (its quantized weights, as
served) — ``--rows`` requests of 4 random rank-``--rank`` adapters in turn (all projections), vs the
base model alone, greedy, ``--tokens`` each. A short run on a shared box: noisy, read the ratio.

    python bench/lora.py --kernels
    python bench/lora.py --rows 32 --tokens 32
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (576, [576, 192, 192]), "o": (576, [576]), "gate_up": (576, [1536, 1536]), "down": (1536, [576])}
LAYERS = 30


def _adapters(n: int, rank: int):
    """Per adapter and projection: A [S*r, in], block-diagonal B [out, S*r] (as ``LoraLayer``)."""
    out = []
    for _ in range(n):
        per = {}
        for name, (k, segs) in SHAPES.items():
            a = torch.randn(len(segs) * rank, k) * 0.02
            b = torch.block_diag(*[torch.randn(w, rank) * 0.02 for w in segs])
            per[name] = (a, b)
        out.append(per)
    return out


def bmm(x, y, stacked, idx, name):
    a_all, b_all = stacked[name]
    a, b = a_all[idx], b_all[idx]  # [T, R, in], [T, out, R]
    y += torch.bmm(b, torch.bmm(a, x.unsqueeze(2))).squeeze(2)


def grouped(x, y, ads, groups, name):
    """Each adapter's rows gathered, two matmuls, added back."""
    for i, rows in groups:
        a, b = ads[i][name]
        y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))


def kernels(rows: int, n: int, rank: int, reps: int) -> None:
    from kvledger.model import lora

    torch.manual_seed(0)
    ads = _adapters(n, rank)
    stacked = {name: (torch.stack([a[name][0] for a in ads]), torch.stack([a[name][1] for a in ads])) for name in SHAPES}
    layers = {}
    for name, (k, segs) in SHAPES.items():  # kvledger's own layer, with the same matrices
        layers[name] = lora.LoraLayer(0, [(str(i), w) for i, w in enumerate(segs)], k, "cpu", torch.float32)
        for i, a in enumerate(ads):
            layers[name].weights[f"a{i}"] = a[name]
    for order in ("interleaved", "sorted"):
        idx = torch.arange(rows) % n if order == "interleaved" else torch.arange(rows) * n // rows
        batch = lora.LoraBatch.of([f"a{i}" for i in idx.tolist()], [1] * rows, "cpu")
        groups = [(i, (idx == i).nonzero().flatten()) for i in range(n)]
        xs = {name: torch.randn(rows, k) for name, (k, _) in SHAPES.items()}
        ys = {name: torch.zeros(rows, sum(s)) for name, (_, s) in SHAPES.items()}

        def ours(nm, xs=xs, ys=ys, batch=batch):
            with lora.active(batch):
                layers[nm](xs[nm], ys[nm])

        ways = {
            "kvledger": ours,
            "grouped": lambda nm, xs=xs, ys=ys, groups=groups: grouped(xs[nm], ys[nm], ads, groups, nm),
            "bmm": lambda nm, xs=xs, ys=ys, idx=idx: bmm(xs[nm], ys[nm], stacked, idx, nm),
        }
        ref = None
        for way, f in ways.items():
            for y in ys.values():
                y.zero_()
            for nm in SHAPES:
                f(nm)
            got = torch.cat([ys[nm] for nm in SHAPES], 1)
            ref = got.clone() if ref is None else ref
            assert torch.allclose(got, ref, atol=1e-4), way
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(LAYERS):
                    for nm in SHAPES:
                        f(nm)
                times.append(time.perf_counter() - t0)
            print(f"{order:11s} {way:8s} {min(times) * 1e3:7.2f} ms per forward (best of {reps}) "
                  f"({rows} rows, {n} adapters, rank {rank}, {LAYERS} layers)")  # fmt: skip


def throughput(rows: int, tokens: int, rank: int, n: int) -> None:
    from peft import LoraConfig
    from safetensors.torch import save_file

    from kvledger import Engine

    eng = Engine(enable_lora=True, max_total_tokens=16384, max_running_requests=rows, max_loras_per_batch=n)
    cfg = eng.core.model.cfg
    torch.manual_seed(0)
    d = tempfile.mkdtemp(prefix="kvledger-bench-lora-")
    mods = {"q_proj": ("self_attn", cfg.num_heads * cfg.head_dim), "k_proj": ("self_attn", cfg.num_kv_heads * cfg.head_dim),
            "v_proj": ("self_attn", cfg.num_kv_heads * cfg.head_dim), "o_proj": ("self_attn", cfg.hidden_size),
            "gate_proj": ("mlp", cfg.intermediate_size), "up_proj": ("mlp", cfg.intermediate_size),
            "down_proj": ("mlp", cfg.hidden_size)}  # fmt: skip
    for i in range(n):
        path = os.path.join(d, f"a{i}")
        LoraConfig(r=rank, lora_alpha=rank, target_modules=list(mods)).save_pretrained(path)
        t = {}
        for layer in range(cfg.num_layers):
            for m, (part, out) in mods.items():
                k = cfg.intermediate_size if m == "down_proj" else cfg.hidden_size
                p = f"base_model.model.model.layers.{layer}.{part}.{m}"
                t[f"{p}.lora_A.weight"] = torch.randn(rank, k) * 0.01
                t[f"{p}.lora_B.weight"] = torch.randn(out, rank) * 0.01
        save_file(t, os.path.join(path, "adapter_model.safetensors"))
        eng.load_lora_adapter(f"a{i}", path)
    prompts = [[1 + (j * 7 + r) % 1000 for j in range(16)] for r in range(rows)]
    sp = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    eng.generate(input_ids=prompts[:2], sampling_params={**sp, "max_new_tokens": 2})  # warm-up
    for label, names in (("base model alone", [None] * rows), (f"{n} adapters + base, in turn", None),
                         (f"{n} adapters, in turn", [f"a{r % n}" for r in range(rows)])):  # fmt: skip
        if names is None:
            names = [None if r % (n + 1) == n else f"a{r % (n + 1)}" for r in range(rows)]
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=[{**sp, "lora_path": x} if x else sp for x in names])
        dt = time.perf_counter() - t0
        print(f"{label:28s} {rows * tokens / dt:7.1f} tok/s ({rows} x {tokens} tokens, prompt 16, {dt:.1f} s)")
    eng.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    if a.kernels:
        kernels(a.rows, a.adapters, a.rank, a.reps)
    else:
        throughput(a.rows, a.tokens, a.rank, a.adapters)


if __name__ == "__main__":
    main()
