"""HiSparse's C++ kernel (csrc/hisparse.cpp) against its torch reference (``model/hisparse.quest_pages``).

One call a layer for every sparse row: the new token's K/V land in its host page and fold into that
page's min/max summary; each KV head's pages are Quest's choice (the same pages as the reference); the
attention over them, read in place in the host pool, is the reference's SDPA over the same pages; a
dense layer (top_k < 0) reads every page and gives dense attention's output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvledger import kernels
from kvledger.model.hisparse import quest_pages

pytestmark = pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not load here")

LAYERS, KVH, GROUP, D, PS = 3, 2, 3, 64, 4
SINK, RECENT, TOP_K = 1, 2, 3


def _pool(dtype: torch.dtype, host_pages: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (host_pages, LAYERS, KVH, PS, D)
    host_k = torch.randn(shape, generator=g).to(dtype)
    host_v = torch.randn(shape, generator=g).to(dtype)
    # [layers, pages, KVH, 2, D] in the pool's dtype (min/max of its values: exact)
    summary = torch.stack([host_k.amin(3), host_k.amax(3)], 3).transpose(0, 1).contiguous()
    return host_k, host_v, summary


def _case(dtype: torch.dtype, lens: list[int], seed: int = 0):
    """Rows with their own host pages (shuffled ids), random q and new K/V."""
    g = torch.Generator().manual_seed(seed + 1)
    need = [-(-n // PS) + 1 for n in lens]  # a spare page past each row's last
    host_k, host_v, summary = _pool(dtype, sum(need) + 2, seed)
    ids = torch.randperm(sum(need) + 2, generator=g).tolist()
    width = max(need)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = torch.tensor(ids[at : at + n])
        at += n
    q = torch.randn(len(lens), KVH * GROUP, D, generator=g).to(dtype)
    k_new = torch.randn(len(lens), KVH, D, generator=g).to(dtype)
    v_new = torch.randn(len(lens), KVH, D, generator=g).to(dtype)
    return q, k_new, v_new, host_k, host_v, summary, table, torch.tensor(lens, dtype=torch.int64)


def _expected_summary(summary, k_new, table, lens, layer):
    """The summaries after the new tokens: a page the new token starts is that token alone; otherwise
    the page's min/max widened by it."""
    want = summary.clone()
    for r, n in enumerate(lens.tolist()):
        pos = n - 1
        hp = int(table[r, pos // PS])
        kf = k_new[r]
        if pos % PS == 0:
            want[layer, hp, :, 0], want[layer, hp, :, 1] = kf, kf
        else:
            want[layer, hp, :, 0] = torch.minimum(want[layer, hp, :, 0], kf)
            want[layer, hp, :, 1] = torch.maximum(want[layer, hp, :, 1], kf)
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [TOP_K, -1])
def test_kernel_matches_the_reference(dtype, top_k):
    layer = 1
    lens = [37, 9, 64, 13]  # 10, 3 (fewer than the budget: every page), 16 and 4 pages; a new page at 13
    q, k_new, v_new, host_k, host_v, summary, table, lens_t = _case(dtype, lens)
    ref_k, ref_v = host_k.clone(), host_v.clone()
    for r, n in enumerate(lens):  # where the kernel must write the new token
        hp = int(table[r, (n - 1) // PS])
        ref_k[hp, layer, :, (n - 1) % PS], ref_v[hp, layer, :, (n - 1) % PS] = k_new[r], v_new[r]
    want_summary = _expected_summary(summary, k_new, table, lens_t, layer)
    # The selection alone, on copies: the table names each head's host pages, in order.
    hk, hv, sm = host_k.clone(), host_v.clone(), summary.clone()
    sel, counts = torch.ops.kvledger_cpu.hisparse_select(q, k_new, v_new, hk, hv, sm, layer, table, lens_t,
                                                         SINK, RECENT, top_k)  # fmt: skip
    assert torch.equal(hk, ref_k) and torch.equal(hv, ref_v)
    torch.testing.assert_close(sm, want_summary, rtol=0, atol=0)
    width = sel.shape[1] // KVH
    out = torch.ops.kvledger_cpu.hisparse_attention(q, k_new, v_new, host_k, host_v, summary, layer, table, lens_t,
                                                    SINK, RECENT, top_k, D**-0.5)  # fmt: skip
    for r, n in enumerate(lens):
        n_pages = (n - 1) // PS + 1
        qr = q[r].view(KVH, GROUP, D)
        chosen = (
            np.broadcast_to(np.arange(n_pages - 1), (KVH, n_pages - 1))
            if top_k < 0
            else quest_pages(want_summary, table[r], layer, qr, n_pages, SINK, RECENT, top_k)
        )
        assert int(counts[r]) == chosen.shape[1] * PS + (n - 1) % PS + 1
        for h in range(KVH):
            pages = [*chosen[h].tolist(), n_pages - 1]
            got = sel[r, h * width : h * width + len(pages) * PS : PS] // (LAYERS * KVH * PS)
            assert got.tolist() == [int(table[r, p]) for p in pages], (r, h)
            # attention over those pages, from the updated pool, in the reference's SDPA
            hp = table[r, torch.tensor(pages)]
            kk = ref_k[hp, layer, h].reshape(-1, D)[: int(counts[r])].float()
            vv = ref_v[hp, layer, h].reshape(-1, D)[: int(counts[r])].float()
            o = F.scaled_dot_product_attention(qr[h].float()[None], kk[None], vv[None], scale=D**-0.5)[0]
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(out[r].view(KVH, GROUP, D)[h].float(), o, rtol=tol, atol=tol)
    assert torch.equal(host_k, ref_k)  # the attention call wrote the same new tokens


def test_a_dense_layer_reads_every_page_as_the_dense_kernel_does():
    """top_k < 0 over the host pool in place: the same bits as the dense decode kernel over the same
    K/V laid out as a KV pool (the one order of sums)."""
    lens = [41, 17]
    q, k_new, v_new, host_k, host_v, summary, table, lens_t = _case(torch.bfloat16, lens, seed=3)
    layer = 2
    out = torch.ops.kvledger_cpu.hisparse_attention(q, k_new, v_new, host_k, host_v, summary, layer, table, lens_t,
                                                    SINK, RECENT, -1, D**-0.5)  # fmt: skip
    # The same K/V as a KV pool [KVH, locations, D]: row r's pages laid out in its slot-table row.
    pages = table.shape[1]
    k_pool = host_k[table.flatten(), layer].permute(1, 0, 2, 3).reshape(KVH, -1, D).contiguous()
    v_pool = host_v[table.flatten(), layer].permute(1, 0, 2, 3).reshape(KVH, -1, D).contiguous()
    slots = torch.arange(len(lens) * pages * PS, dtype=torch.int64).view(len(lens), pages * PS)
    dense = torch.ops.kvledger_cpu.decode_attention(q, k_pool, v_pool, slots, torch.arange(len(lens)), lens_t,
                                                    D**-0.5)  # fmt: skip
    assert torch.equal(out, dense)


def test_bad_arguments_are_refused():
    q, k_new, v_new, host_k, host_v, summary, table, lens_t = _case(torch.float32, [9])
    with pytest.raises(RuntimeError, match="past its host pages"):
        torch.ops.kvledger_cpu.hisparse_select(q, k_new, v_new, host_k, host_v, summary, 0, table,
                                               torch.tensor([99]), SINK, RECENT, TOP_K)  # fmt: skip
    with pytest.raises(RuntimeError, match="outside the host pool"):
        torch.ops.kvledger_cpu.hisparse_select(q, k_new, v_new, host_k, host_v, summary, LAYERS, table, lens_t,
                                               SINK, RECENT, TOP_K)  # fmt: skip


_SCALAR_CHILD = """
import sys, torch
sys.path.insert(0, {root!r})
from kvledger import kernels
assert kernels.load()
from tests.unit.test_hisparse_kernel import _case
q, k_new, v_new, host_k, host_v, summary, table, lens = _case(torch.bfloat16, [37, 9, 64, 13], seed=4)
sel, counts = torch.ops.kvledger_cpu.hisparse_select(q, k_new, v_new, host_k, host_v, summary, 1, table, lens, 1, 2, 3)
torch.save((sel, counts), {out!r})
"""


def test_the_portable_scoring_chooses_the_avx512_pages(tmp_path):
    """``KVLEDGER_CPU_ISA=scalar`` (a CPU without AVX-512): the plain-loop scoring picks the same pages
    as this process's kernel (AVX-512 where the CPU has it), in a child process (the ISA is read once)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    out = tmp_path / "scalar.pt"
    env = {**os.environ, "KVLEDGER_CPU_ISA": "scalar"}
    subprocess.run([sys.executable, "-c", _SCALAR_CHILD.format(root=root, out=str(out))], env=env, check=True,
                   timeout=300)  # fmt: skip
    q, k_new, v_new, host_k, host_v, summary, table, lens = _case(torch.bfloat16, [37, 9, 64, 13], seed=4)
    sel, counts = torch.ops.kvledger_cpu.hisparse_select(q, k_new, v_new, host_k, host_v, summary, 1, table, lens,
                                                         SINK, RECENT, TOP_K)  # fmt: skip
    want_sel, want_counts = torch.load(out)
    assert torch.equal(counts, want_counts) and torch.equal(sel, want_sel)
