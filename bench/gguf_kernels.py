"""GGUF-block linear (``kvledger_cpu::gguf_linear``) per kind against the packed Q4_1 / Q8_0 kernel
(``quant_linear``): median time a call and weight bytes read per second, at a few row counts. Each
GGUF row is timed twice in the same run: ``rows`` is the rows' path (``tile_rows=0``: each weight row
decoded once, up to 8 activation rows dot it; main's kernel before the tiles), ``tiles`` the default
dispatch (the tiles' path from ``kGgufTileRows`` rows; at fewer rows it is the rows' path again), and
for Q4_K / Q6_K ``packed`` the load-time repack's kernel (``GgufWeight.repack``: 16 rows interleaved,
every batch); GB/s are the file's bytes over the time (the repacked Q4_K holds 2.8% more).

    python bench/gguf_kernels.py [--rows 1 8 32 256] [--reps 300] [--kinds Q4_K Q6_K] [--shapes 8192x2048]

Shapes are ``N x K`` (outputs x inputs): 2048 x 640 and 640 x 2048 (Gemma 3 270M's MLP); the
K-quants need K a multiple of 256, so their first shape is 2048 x 768. Random blocks with valid scales.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch

from kvledger import kernels
from kvledger.kernels.gguf_weight import GGUF_PACKED, GGUF_REPACK_KINDS
from kvledger.kernels.quant import pack

KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K"]


def blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    qt = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    d = np.float16(0.001).tobytes()
    if kind == "Q6_K":
        raw[..., 208:210] = np.frombuffer(d, np.uint8)
    else:
        raw[..., 0:2] = np.frombuffer(d, np.uint8)
        if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            raw[..., 2:4] = np.frombuffer(d, np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def timed(fn, args: tuple, reps: int) -> float:
    for _ in range(10):
        fn(*args)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--kinds", nargs="+", default=KINDS)
    ap.add_argument("--shapes", nargs="+", default=["2048x640", "640x2048"], help="N x K (outputs x inputs)")
    ap.add_argument("--no-packed-int", action="store_true", help="skip the packed Q4_1 / Q8_0 rows")
    args = ap.parse_args()
    assert kernels.load(), kernels.status()
    print(f"quant isa {kernels.quant_isa()}, threads {torch.get_num_threads()}")
    rng = np.random.default_rng(0)
    print(
        f"{'kernel':<18}{'N x K':>12}{'rows':>6}{'us rows':>10}{'GB/s':>8}{'us tiles':>10}{'GB/s':>8}"
        f"{'us packed':>10}{'GB/s':>8}"
    )
    for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes):
        for kind in args.kinds:
            kk = (k + 255) // 256 * 256 if kind.endswith("_K") else k
            w = blocks(kind, n, kk, rng)
            tid = int(gguf.GGMLQuantizationType[kind])
            for m in args.rows:
                x = torch.randn(m, kk, dtype=torch.bfloat16)
                reps = max(20, args.reps * 8 // max(m, 8))
                f = torch.ops.kvledger_cpu.gguf_linear
                t0 = timed(f, (x, w, tid, n, kk, None, 0), reps)
                t1 = timed(f, (x, w, tid, n, kk), reps)
                packed = ""
                if kind in GGUF_REPACK_KINDS and kernels.quant_isa() == "avx512-vnni":
                    pw = torch.ops.kvledger_cpu.gguf_repack(
                        [w.reshape(-1)], torch.tensor([[tid, n]]), kk, False
                    )
                    t2 = timed(f, (x, pw, tid + GGUF_PACKED, n, kk), reps)
                    packed = f"{t2 * 1e6:>10.1f}{w.numel() / t2 / 1e9:>8.2f}"
                print(
                    f"{'gguf ' + kind:<18}{f'{n}x{kk}':>12}{m:>6}{t0 * 1e6:>10.1f}{w.numel() / t0 / 1e9:>8.2f}"
                    f"{t1 * 1e6:>10.1f}{w.numel() / t1 / 1e9:>8.2f}{packed}"
                )
        if args.no_packed_int or k % 32:
            continue
        for bits in (4, 8):
            pw = pack(torch.randn(n, k) * 0.02, bits)
            for m in args.rows:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                t = timed(pw, (x,), max(20, args.reps * 8 // max(m, 8)))
                name = f"packed {'Q4_1' if bits == 4 else 'Q8_0'}"
                print(f"{name:<18}{f'{n}x{k}':>12}{m:>6}{'':>18}{t * 1e6:>10.1f}{pw.nbytes() / t / 1e9:>8.2f}")


if __name__ == "__main__":
    main()
