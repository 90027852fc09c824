"""Extends (prefill chunks) through SDPA: each over its whole sequence gathered from the pool, or,
without a cached prefix, over its own new K/V, several prompts to one call (``FRESH_PAD``). The torch
backend runs every extend here; the cpu backend its long ones under ``--cpu-amx on``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cast import widen

FRESH_PAD = 1.25
"""Fresh extends share an SDPA call when the longest of the call is at most this times each one."""


def attend_extends(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ext, scale: float,
    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Attention of each extend (a prefill chunk) over its whole sequence, into ``out`` rows. An
    extend without a cached prefix attends over its own new K/V, ``k``/``v`` [T, KVH, D] where
    given (``store``'s: the values the pool holds, in the model's dtype): no gather from the pool
    (over a float8 pool no widening of the gathered copy either: a 1,024-token prompt 289 -> 271
    ms); outside float32 several of those run in one SDPA call (``_fresh_together``)."""
    fresh = []
    for e in ext:
        start, n, kv_idx, mask = e
        if k is not None and v is not None and kv_idx.numel() == n:
            fresh.append(e)
            continue
        qe = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        ke = widen(k_cache.index_select(1, kv_idx), q.dtype).unsqueeze(0)  # [1, KVH, S, D]
        ve = widen(v_cache.index_select(1, kv_idx), q.dtype).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qe, ke, ve, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        out[start : start + n] = o[0].transpose(0, 1)
    if fresh:
        _fresh_together(out, q, k, v, fresh, scale)


def _fresh_together(out, q, k, v, fresh: list, scale: float) -> None:
    """Extends without a cached prefix (new prompts), over their own K/V: several per SDPA call,
    right-padded to the longest of the call (one gather each of q, k, v). Causal masking keeps
    every real row's view to its own prompt's earlier tokens, so the padding is never seen, and
    its rows are dropped.
    One call per prompt costs a fixed ~50 us a layer around ~100 us of work for a 128-token
    prompt; 16 of them in one call take 1.2 ms a layer instead of 1.5 (bench/RESULTS.md). The
    float32 reference path keeps one call per prompt, its shapes those of transformers'."""
    fresh.sort(key=lambda e: -e[1])
    i = 0
    while i < len(fresh):
        top = fresh[i][1]
        j = i + 1
        if q.dtype != torch.float32:
            while j < len(fresh) and fresh[j][1] * FRESH_PAD >= top:
                j += 1
        group = fresh[i:j]
        i = j
        if len(group) == 1:
            start, n = group[0][:2]
            qe, ke, ve = (t[start : start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=scale, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1)
            continue
        s0, b = group[0][0], len(group)
        if all(e[1] == top and e[0] == s0 + g * top for g, e in enumerate(group)):
            # Equal prompts side by side (the sort is stable: in token order): views, no gather.
            qe, ke, ve = (t[s0 : s0 + b * top].view(b, top, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=scale, enable_gqa=True)
            out[s0 : s0 + b * top].view(b, top, *q.shape[1:]).copy_(o.transpose(1, 2))
            continue
        # Row r of prompt g is token starts[g] + r; past its n the index repeats its last token
        # (any finite row will do: no real row sees it).
        starts = torch.tensor([e[0] for e in group]).unsqueeze(1)
        lens = torch.tensor([e[1] for e in group]).unsqueeze(1)
        pos = torch.arange(top).unsqueeze(0)
        rows = (starts + torch.minimum(pos, lens - 1)).flatten().to(q.device)
        qe, ke, ve = (t.index_select(0, rows).view(len(group), top, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=scale, enable_gqa=True)
        real = (pos < lens).flatten().to(q.device)
        out.index_copy_(0, rows[real], o.transpose(1, 2).reshape(-1, *q.shape[1:])[real])
