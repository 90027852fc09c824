"""The captured decode step's attention (``model/attention_graph.py``) against the reference backend
(``TorchAttention``, the eager path): the fixed-shape torch version everywhere, and the Triton kernel
(``kernels/triton_decode.py``) under Triton's interpreter on CPU tensors. Triton is installed wherever
kvledger is on Linux x86-64 (xgrammar requires it there); on CUDA torch needs it too."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch

from kvledger.kernels import triton_decode
from kvledger.model.attention import TorchAttention
from kvledger.model.attention_graph import GraphDecodeAttention, GraphDecodeMeta, decode_torch
from kvledger.model.batch import ForwardBatch

SHAPES = [(4, 2, 16), (9, 3, 64), (4, 4, 8)]  # (heads, kv heads, head dim): groups of 2, 3 and 1


class _KV:
    def __init__(self, layers: int, kvh: int, tokens: int, d: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(layers, kvh, tokens, d, generator=g)
        self.v = torch.randn(layers, kvh, tokens, d, generator=g)


def _decode_batch(rng: random.Random, page_size: int, num_pages: int, width: int, B: int):
    """A page table whose rows own random, disjoint pages, and a decode batch of ``B`` of them (the
    last with the row's whole width, one with a single token)."""
    slots = 2 * B
    pages = list(range(num_pages))
    rng.shuffle(pages)
    table = torch.zeros(slots + 1, width, dtype=torch.int64)
    per_row = width // page_size
    for s in range(slots):
        mine = torch.tensor(pages[s * per_row : (s + 1) * per_row])
        table[s] = (mine.unsqueeze(1) * page_size + torch.arange(page_size)).flatten()
    rows = rng.sample(range(slots), B)
    lens = [rng.randint(1, width) for _ in range(B)]
    lens[-1], lens[0] = width, 1
    batch = ForwardBatch(
        input_ids=torch.zeros(B, dtype=torch.int64), positions=torch.tensor([n - 1 for n in lens]),
        out_loc=table[rows, [n - 1 for n in lens]], req_rows=rows, prefix_lens=[n - 1 for n in lens],
        extend_lens=[1] * B, seq_lens=lens, logit_index=torch.arange(B), req_to_token=table, page_size=page_size,
    )  # fmt: skip
    return batch, torch.tensor(rows), torch.tensor(lens)


def _reference(H, KVH, D, kv, batch, q, k, v, layer=1):
    """The eager backend's output (it stores the new K/V first, as the graph backend does)."""
    ref = TorchAttention(H, KVH, D)
    ref.prepare(batch)
    return ref.forward(layer, q, k, v, kv, batch)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("B", [1, 3, 8])
def test_graph_backend_equals_the_reference_backend(page_size, shape, B):
    H, KVH, D = shape
    rng = random.Random(B * 100 + page_size + H)
    width = 64
    num_pages = (2 * B * width) // page_size + 4
    batch, rows, lens = _decode_batch(rng, page_size, num_pages, width, B)
    kv_ref = _KV(2, KVH, num_pages * page_size, D, seed=B)
    kv = _KV(2, KVH, num_pages * page_size, D, seed=B)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, n, D, generator=g) for n in (H, KVH, KVH))
    want = _reference(H, KVH, D, kv_ref, batch, q, k, v)
    graph = GraphDecodeAttention(H, KVH, D, D**-0.5, "torch")
    batch.attn_meta = GraphDecodeMeta(rows, lens)
    got = graph.forward(1, q, k, v, kv, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # It stored the new K/V where the reference did, and touched nothing else.
    assert torch.equal(kv.k, kv_ref.k) and torch.equal(kv.v, kv_ref.v)


def test_torch_version_reads_only_each_rows_own_tokens():
    """Keys past a row's length (and other rows' pages) change nothing: the mask is by length."""
    rng = random.Random(3)
    batch, rows, lens = _decode_batch(rng, 16, 40, 64, 4)
    kv = _KV(1, 2, 40 * 16, 16, seed=1)
    q = torch.randn(4, 4, 16)
    before = decode_torch(q, kv.k[0], kv.v[0], batch.req_to_token, rows, lens, 0.25)
    for b in range(4):  # scribble over every token a row does not attend
        past = batch.req_to_token[rows[b], lens[b] :]
        kv.k[0][:, past] = 1e4
        kv.v[0][:, past] = -1e4
    after = decode_torch(q, kv.k[0], kv.v[0], batch.req_to_token, rows, lens, 0.25)
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def _triton_cases() -> int:
    """Every case of the kernel test, in this process (run with TRITON_INTERPRET=1 set before Triton is
    imported: the interpreter replaces its language at import). Returns the number of cases."""
    n = 0
    for page_size in (1, 16):
        for H, KVH, D in SHAPES:
            for block_n in (16, 64):
                rng = random.Random(page_size + H + block_n)
                B, width = 5, 96
                num_pages = (2 * B * width) // page_size + 2
                batch, rows, lens = _decode_batch(rng, page_size, num_pages, width, B)
                kv = _KV(2, KVH, num_pages * page_size, D, seed=2)
                g = torch.Generator().manual_seed(11)
                q, k, v = (torch.randn(B, n_heads, D, generator=g) for n_heads in (H, KVH, KVH))
                want = _reference(H, KVH, D, kv, batch, q, k, v)  # (stores k/v: the kernel reads them too)
                got = triton_decode.decode(
                    q, kv.k[1], kv.v[1], batch.req_to_token, rows, lens, D**-0.5, block_n=block_n
                )
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                n += 1
    return n


TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not TRITON, reason="triton is not installed (xgrammar brings it on Linux x86-64 only)")
def test_triton_kernel_under_the_interpreter():
    """The kernel itself on CPU tensors (TRITON_INTERPRET=1), lengths from 1 to a row's whole width,
    not multiples of the block, pages of 1 and 16, groups of 1-3 query heads, against the reference
    backend. In a child process: the interpreter must be chosen before Triton is imported."""
    code = "from tests.unit.test_graph_attention import _triton_cases; print('cases', _triton_cases())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "cases 12" in r.stdout, r.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_kernel_on_cuda(dtype, page_size):
    """On a GPU: the compiled kernel against the reference backend on the same device (fp32 to 1e-5;
    bf16 to bf16's rounding of the output)."""
    for H, KVH, D in [*SHAPES, (9, 3, 64)]:
        rng = random.Random(page_size + H)
        B, width = 7, 256
        num_pages = (2 * B * width) // page_size + 2
        batch, rows, lens = _decode_batch(rng, page_size, num_pages, width, B)
        batch.req_to_token, batch.out_loc = batch.req_to_token.cuda(), batch.out_loc.cuda()
        kv = _KV(2, KVH, num_pages * page_size, D, seed=4)
        kv.k, kv.v = kv.k.to("cuda", dtype), kv.v.to("cuda", dtype)
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(B, n, D, generator=g).to("cuda", dtype) for n in (H, KVH, KVH))
        want = _reference(H, KVH, D, kv, batch, q, k, v)
        got = triton_decode.decode(q, kv.k[1], kv.v[1], batch.req_to_token, rows.cuda(), lens.cuda(), D**-0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
