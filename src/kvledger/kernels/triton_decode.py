"""Paged decode attention in Triton, for the captured decode step (``engine/graph_runner.py``).

One query token per row; its keys and values are read in place from the KV pool through the row's
line of the request->token table (``req_to_token[row, j]`` is the cache location of token ``j``,
``page * page_size + offset``: the page table at token granularity), for the ``seq_lens[b]`` tokens
of the row. The launch has a fixed shape (a program per row and KV head, the group of query heads
that share the KV head together), and the length is read inside the kernel, so one launch serves any
lengths: what a CUDA graph needs. Online softmax in float32 over blocks of ``BLOCK_N`` tokens.

Triton is imported lazily (``available()``): a CUDA build of torch ships it; a CPU build does not,
and the graph runner's CPU path uses ``model/attention_graph.decode_torch`` instead. With
``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (tests/unit/test_graph_attention.py).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> str | None:
    """None where Triton imports, else why not (one line)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not installed ({type(e).__name__}: {e})"
    return None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_kernel(
        Q, K, V, Table, Rows, Lens, Out,
        stride_qb, stride_qh, stride_kh, stride_kl, stride_vh, stride_vl, stride_t, stride_ob, stride_oh,
        scale,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.load(Rows + b)
        n = tl.load(Lens + b)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D_P)
        gm = g < GROUP
        dm = d < D
        heads = kvh * GROUP + g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        s_sum = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D_P], tl.float32)
        for start in range(0, n, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jm = j < n
            loc = tl.load(Table + row * stride_t + j, mask=jm, other=0)
            kv_mask = jm[:, None] & dm[None, :]
            k = tl.load(K + kvh * stride_kh + loc[:, None] * stride_kl + d[None, :], mask=kv_mask, other=0.0)
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # [GROUP_P, BLOCK_N]
            s = tl.where(jm[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(V + kvh * stride_vh + loc[:, None] * stride_vl + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            s_sum = s_sum * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / s_sum[:, None]
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=gm[:, None] & dm[None, :])  # fmt: skip

    return decode_kernel


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, D]`` over each row's first ``seq_lens[b]`` (>= 1) tokens, whose
    locations are ``table[rows[b], :seq_lens[b]]``; ``k_cache``/``v_cache`` ``[KVH, locations, D]``
    (one layer of the pool). Returns ``[B, H * D]`` in ``q``'s dtype."""
    B, H, D = q.shape
    kvh = k_cache.shape[0]
    group = H // kvh
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or table.stride(1) != 1:
        raise ValueError("decode attention needs the KV pool's head dim and the page table's rows contiguous")
    q = q.contiguous()
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    _kernel()[(B, kvh)](
        q, k_cache, v_cache, table, rows, seq_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), out.stride(0), out.stride(1),
        scale,
        GROUP=group, GROUP_P=_pow2(group), D=D, D_P=_pow2(D), BLOCK_N=block_n,
    )  # fmt: skip
    return out.view(B, H * D)


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (Triton's block shapes), at least 2."""
    return max(2, 1 << (n - 1).bit_length())
