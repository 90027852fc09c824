"""Attention backends. The model calls ``prepare`` once per forward and ``forward`` once per layer.

A CUDA backend (flashinfer, triton) implements the same two methods and is chosen by name in
``make_backend`` (``attention_cpu.py``, beside the other backend it chooses between); the model code
does not change.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .batch import ForwardBatch

FP8_MAX = 448.0  # float8 e4m3's largest finite value: torch's cast makes NaN of what lies beyond


def _f8_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """The C++ float8 casts apply to/from ``dtype`` on ``device`` (torch's run ~2 ns an element, on
    one thread)."""
    from .. import kernels

    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and kernels.load()


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the pool's element type; into a float8 pool rounded to nearest even and saturating at
    +-448, as the C++ decode kernel writes new tokens (a NaN in the cache would poison every later
    query's softmax): the kernels' cast where they load, torch's cast of the clamped value elsewhere
    (the same bytes: a test holds them equal)."""
    if dtype == torch.float8_e4m3fn:
        if _f8_kernels(x.device, x.dtype):
            return torch.ops.kvledger_cpu.to_f8(x)
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V gathered from the pool, in the queries' ``dtype`` (a copy only where the pool is float8;
    exact either way)."""
    if x.dtype == dtype:
        return x
    if x.dtype == torch.float8_e4m3fn and _f8_kernels(x.device, dtype):
        return torch.ops.kvledger_cpu.from_f8(x, dtype)
    return x.to(dtype)


class KVBuffer(Protocol):
    """Per-layer K and V storage: ``k[layer]`` and ``v[layer]`` are ``[kv_heads, num_pages * page_size, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor


class AttentionBackend(Protocol):
    def prepare(self, batch: ForwardBatch) -> None:
        """Build the per-forward metadata (index tensors, masks) into ``batch.attn_meta``."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_buffer: KVBuffer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Store the new k/v of ``layer`` into the pool and return attention output ``[T, heads*head_dim]``."""


@dataclass
class _TorchMeta:
    # decode group: requests that bring exactly one token (batched as two padded matmuls)
    dec_tok: torch.Tensor | None  # [Bd] flat token index of each
    dec_kv_idx: torch.Tensor | None  # [Bd, Pmax] KV pages (padded with page 0)
    dec_mask: torch.Tensor | None  # [1, Bd, 1, Lmax] additive mask (0 / -inf)
    # extend group: requests that bring several tokens (one SDPA call each)
    ext: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (tok_start, n, kv_idx [S], mask [n,S])
    dec_len0: int = 0  # sequence length of the first decode (used when there is only one)
    dec_k_buf: torch.Tensor | None = None  # gather buffers shared by all layers of one forward
    dec_v_buf: torch.Tensor | None = None
    sparse: tuple | None = None  # HiSparse decodes: (flat token index tensor, slots, sequence lengths)
    special: list[bool] | None = None  # the layers that run attend_spans (``special_layers``)
    spans: list | None = None  # every request, for those layers (``spans``)


@dataclass
class BatchSplit:
    """One forward's requests by the attention they need (``TorchAttention.split``)."""

    dec_tok: list[int]  # decodes: flat token index,
    dec_rows: list[int]  # request-slot row,
    dec_lens: list[int]  # sequence length (the new token included)
    sdpa_ext: list  # extends for SDPA: (tok_start, n, kv_idx [S], mask [n, S] or None: plain causal)
    kernel_ext: list[list[int]]  # extends for a backend's kernel: [rows, tok_starts, prefixes, new tokens]
    # HiSparse decodes (``batch.sparse_rows``): flat token index, request-slot row, sequence length
    sparse: tuple[list[int], list[int], list[int]] = ((), (), ())  # type: ignore[assignment]


class TorchAttention:
    """Reference backend in plain PyTorch; runs anywhere, exact in fp32.

    Decodes use a hand-written grouped-query attention (two batched matmuls): on CPUs bf16
    ``scaled_dot_product_attention`` is several times slower for one query row (see PERF-NOTES).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        windows: list[int | None] | None = None,
        softcap: float | None = None,
        sinks: list[torch.Tensor | None] | None = None,
    ):
        """``scale``: of the scores (default ``head_dim ** -0.5``); ``windows``: each layer's sliding
        window (None: full attention); ``softcap``: ``cap * tanh(scores / cap)`` on every layer;
        ``sinks``: each layer's attention sinks (GPT-OSS: one learned logit per query head that joins
        every query's softmax denominator and carries no value; ``[heads]``), or None. The layers with
        a window, soft-capping or sinks run ``attend_spans`` (each request over the keys it may see;
        exact, not the fast paths), the others the paths below."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # The KV pool's element type, set by the runner that owns the pool (engine/runner.py); None:
        # the model's. A float8 pool is written clamped (``to_cache``) and read widened (``widen``).
        self.kv_dtype: torch.dtype | None = None
        self.scale = head_dim**-0.5 if scale is None else scale
        self.windows = list(windows or [])
        self.softcap = softcap
        self.sinks = list(sinks or [])
        # attend_spans one query row at a time over exactly its own keys (the cpu backend's
        # --enable-deterministic-inference): each product then has one shape whatever the batch or chunk.
        self.row_wise = False
        self.any_special = (
            softcap is not None
            or any(w is not None for w in self.windows)
            or any(s is not None for s in self.sinks)
        )

    def _window(self, layer: int) -> int | None:
        return self.windows[layer] if layer < len(self.windows) else None

    def _sink(self, layer: int) -> torch.Tensor | None:
        return self.sinks[layer] if layer < len(self.sinks) else None

    def special_layers(self, batch: ForwardBatch) -> list[bool] | None:
        """Which layers of this forward run ``attend_spans``: every layer with soft-capping or sinks
        (a sink's share of each softmax is not in the fast paths), and a windowed layer once some
        sequence of the batch is longer than its window (shorter ones see every key anyway, so the
        fast paths stay exact); None where no layer does."""
        if not self.any_special:
            return None
        longest = max(batch.seq_lens, default=0)
        cap = self.softcap is not None
        n = max(len(self.windows), len(self.sinks))
        special = [
            cap or self._sink(i) is not None or ((w := self._window(i)) is not None and longest > w)
            for i in range(n)
        ] or [cap]
        return special if any(special) else None

    def is_special(self, special: list[bool] | None, layer: int) -> bool:
        if special is None:
            return False
        return special[layer] if layer < len(special) else self.softcap is not None

    @staticmethod
    def spans(batch: ForwardBatch) -> list[tuple[int, int, int, torch.Tensor]]:
        """``(tok_start, prefix, new, kv_idx [prefix + new])`` of every request of the batch."""
        out, start = [], 0
        for row, pre, n in zip(batch.req_rows, batch.prefix_lens, batch.extend_lens):
            if n:
                out.append((start, pre, n, batch.req_to_token[row, : pre + n]))
            start += n
        return out

    def attend_spans(self, layer: int, q, k_cache, v_cache, spans) -> torch.Tensor:
        """Attention of each request over the keys its queries may see (causal, within the layer's
        window), with soft-capping and sinks: scores in fp32 as transformers' eager attention. A
        windowed layer gathers only the last ``window + new - 1`` keys of a request, not its whole
        sequence (a sink is no key: it needs no page)."""
        window = self._window(layer)
        kvh, group, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        sink = self._sink(layer)
        if sink is not None:  # query head h = kv_head * group + g
            sink = sink.float().view(kvh, group, 1, 1)
        out = q.new_empty(q.shape[0], self.num_heads * d)
        dev = q.device
        if self.row_wise:  # one span per query row: its position p sees keys [lo(p), p]
            spans = [(st + i, pre + i, 1, kv[: pre + i + 1]) for st, pre, n, kv in spans for i in range(n)]
        for start, pre, n, kv_idx in spans:
            s = pre + n
            lo = 0 if window is None else max(0, pre - window + 1)
            ke = widen(k_cache.index_select(1, kv_idx[lo:s]), q.dtype).unsqueeze(1)  # [KVH, 1, S', D]
            ve = widen(v_cache.index_select(1, kv_idx[lo:s]), q.dtype).unsqueeze(1)
            qe = q[start : start + n].view(n, kvh, group, d).permute(1, 2, 0, 3)  # [KVH, G, n, D]
            scores = torch.matmul(qe, ke.transpose(-1, -2)).float() * self.scale  # [KVH, G, n, S']
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            qpos = torch.arange(pre, s, device=dev).unsqueeze(1)
            kpos = torch.arange(lo, s, device=dev).unsqueeze(0)
            allowed = kpos <= qpos
            if window is not None:
                allowed &= kpos > qpos - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sink is None:
                probs = torch.softmax(scores, dim=-1).to(ve.dtype)
            else:  # one more column in each softmax, dropped after: it weighs no value
                scores = torch.cat((scores, sink.expand(kvh, group, n, 1)), dim=-1)
                probs = torch.softmax(scores, dim=-1)[..., :-1].to(ve.dtype)
            o = torch.matmul(probs, ve)  # [KVH, G, n, D]
            out[start : start + n] = o.permute(2, 0, 1, 3).reshape(n, self.num_heads * d)
        return out

    @staticmethod
    def split(batch: ForwardBatch, in_kernel: Callable[[int, int], bool] | None = None) -> BatchSplit:
        """The batch's decodes and extends (see ``BatchSplit``); ``in_kernel(prefix, new)`` picks the
        extends a backend runs in its own kernel (the rest go to SDPA)."""
        sp = BatchSplit([], [], [], [], [[], [], [], []], ([], [], []))
        start = 0
        for row, pre, n, s in zip(batch.req_rows, batch.prefix_lens, batch.extend_lens, batch.seq_lens):
            if n == 1 and row in batch.sparse_rows:
                for col, v in zip(sp.sparse, (start, row, s)):
                    col.append(v)
            elif n == 1:
                sp.dec_tok.append(start)
                sp.dec_rows.append(row)
                sp.dec_lens.append(s)
            elif n > 1 and in_kernel is not None and in_kernel(pre, n):
                for col, v in zip(sp.kernel_ext, (row, start, pre, n)):
                    col.append(v)
            elif n > 1:
                sp.sdpa_ext.append(TorchAttention.sdpa_extend(batch, row, start, pre, n))
            start += n
        return sp

    @staticmethod
    def sdpa_extend(batch: ForwardBatch, row: int, start: int, pre: int, n: int) -> tuple:
        """``(tok_start, n, kv_idx [S], mask [n, S] or None)`` of one extend for ``extend``."""
        s = pre + n
        dev = batch.req_to_token.device
        mask = (
            None
            if not pre
            else torch.arange(s, device=dev).unsqueeze(0) <= torch.arange(pre, s, device=dev).unsqueeze(1)
        )
        return start, n, batch.req_to_token[row, :s], mask

    def prepare(self, batch: ForwardBatch) -> None:
        sp = self.split(batch)
        dec_tok, dec_rows, dec_lens = sp.dec_tok, sp.dec_rows, sp.dec_lens
        meta = _TorchMeta(None, None, None, sp.sdpa_ext)
        meta.sparse = self.sparse_meta(sp)
        meta.special = self.special_layers(batch)
        if meta.special is not None:
            meta.spans = self.spans(batch)
        # Every layer attends by spans (a sliding-window model past its window): the decode group's
        # padded page index would go unused (it spans whole rows, out-of-window entries included:
        # memory/window.py), so it is not built.
        if dec_tok and not (meta.special is not None and all(meta.special)):
            ps = batch.page_size
            dev = batch.req_to_token.device
            pmax = -(-max(dec_lens) // ps)
            lmax = pmax * ps
            lens = torch.tensor(dec_lens, device=dev)
            meta.dec_tok = torch.tensor(dec_tok, device=dev)
            meta.dec_len0 = dec_lens[0]
            # Gather whole pages, not tokens: one contiguous page_size*head_dim run per index is several
            # times faster to copy than single token rows (the gather dominates decode time).
            pages = batch.req_to_token[dec_rows, :lmax:ps] // ps
            page_valid = torch.arange(pmax, device=dev).unsqueeze(0) * ps < lens.unsqueeze(1)
            meta.dec_kv_idx = torch.where(page_valid, pages, 0)
            valid = torch.arange(lmax, device=dev).unsqueeze(0) < lens.unsqueeze(1)
            mask = torch.zeros(valid.shape, dtype=torch.float32, device=dev).masked_fill_(
                ~valid, float("-inf")
            )
            meta.dec_mask = mask[None, :, None, :]  # broadcast over [KVH, B, G, L]
        batch.attn_meta = meta

    @staticmethod
    def sparse_meta(sp: BatchSplit) -> tuple | None:
        tok, rows, lens = sp.sparse
        return (torch.tensor(tok), list(rows), list(lens)) if tok else None

    def sparse_decode(self, layer: int, q, k, v, kv_buffer, batch, out: torch.Tensor, sparse: tuple) -> None:
        """HiSparse rows (their new K/V already stored): the worker chooses and fills their pages, then
        attention reads those pages only; into ``out``'s rows (any shape with those rows first)."""
        tok, rows, lens = sparse
        pages, counts = batch.sparse_worker.select(layer, q[tok], k[tok], v[tok], rows, lens, kv_buffer)
        o = self.attend_pages(q[tok], kv_buffer.k[layer], kv_buffer.v[layer], pages, counts, batch.page_size)
        out[tok] = o.view(out[tok].shape)

    def attend_pages(self, q, k_cache, v_cache, pages: torch.Tensor, counts: list[int], page_size: int):
        """Attention of ``q`` ``[R, H, D]`` over each row's and KV head's ``pages`` (``[R, KVH, P]``,
        ``counts`` tokens); ``[R, H * D]``."""
        from .hisparse import SparseWorker

        return SparseWorker.attend_torch(q, k_cache, v_cache, pages, counts, page_size, self.scale)

    @staticmethod
    def store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch) -> tuple:
        """Write the batch's new K/V ``[T, KVH, D]`` into their cache locations; returns them as the
        pool holds them, in ``k``'s dtype (over a float8 pool: rounded, so that a new prompt's own
        attention sees what every later reader of its pages sees, whichever kernel reads them)."""
        if k_cache.dtype == k.dtype:
            k_cache[:, batch.out_loc] = k.transpose(0, 1)
            v_cache[:, batch.out_loc] = v.transpose(0, 1)
            return k, v
        k8, v8 = to_cache(k, k_cache.dtype), to_cache(v, v_cache.dtype)
        k_cache[:, batch.out_loc] = k8.transpose(0, 1)
        v_cache[:, batch.out_loc] = v8.transpose(0, 1)
        return widen(k8, k.dtype), widen(v8, v.dtype)

    def extend(
        self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ext,
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
                qe, ke, ve, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
            out[start : start + n] = o[0].transpose(0, 1)
        if fresh:
            self._fresh_together(out, q, k, v, fresh)

    FRESH_PAD = 1.25
    """Fresh extends share an SDPA call when the longest of the call is at most this times each one."""

    def _fresh_together(self, out, q, k, v, fresh: list) -> None:
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
                while j < len(fresh) and fresh[j][1] * self.FRESH_PAD >= top:
                    j += 1
            group = fresh[i:j]
            i = j
            if len(group) == 1:
                start, n = group[0][:2]
                qe, ke, ve = (t[start : start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=self.scale, enable_gqa=True)
                out[start : start + n] = o[0].transpose(0, 1)
                continue
            s0, b = group[0][0], len(group)
            if all(e[1] == top and e[0] == s0 + g * top for g, e in enumerate(group)):
                # Equal prompts side by side (the sort is stable: in token order): views, no gather.
                qe, ke, ve = (t[s0 : s0 + b * top].view(b, top, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
                o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=self.scale, enable_gqa=True)
                out[s0 : s0 + b * top].view(b, top, *q.shape[1:]).copy_(o.transpose(1, 2))
                continue
            # Row r of prompt g is token starts[g] + r; past its n the index repeats its last token
            # (any finite row will do: no real row sees it).
            starts = torch.tensor([e[0] for e in group]).unsqueeze(1)
            lens = torch.tensor([e[1] for e in group]).unsqueeze(1)
            pos = torch.arange(top).unsqueeze(0)
            rows = (starts + torch.minimum(pos, lens - 1)).flatten().to(q.device)
            qe, ke, ve = (t.index_select(0, rows).view(len(group), top, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=self.scale, enable_gqa=True)
            real = (pos < lens).flatten().to(q.device)
            out.index_copy_(0, rows[real], o.transpose(1, 2).reshape(-1, *q.shape[1:])[real])

    def forward(self, layer, q, k, v, kv_buffer, batch):
        k_cache, v_cache = kv_buffer.k[layer], kv_buffer.v[layer]  # [KVH, locations, D]
        k, v = self.store(k_cache, v_cache, k, v, batch)
        meta: _TorchMeta = batch.attn_meta
        if self.is_special(meta.special, layer):
            return self.attend_spans(layer, q, k_cache, v_cache, meta.spans)
        kvh, group, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        # A batch of decodes only (the common case): the rows are the batch, no scatter/gather of q.
        only_decodes = not meta.ext and meta.dec_tok is not None and meta.dec_tok.shape[0] == q.shape[0]
        out = None if only_decodes else torch.empty_like(q)
        if meta.dec_tok is not None:
            bd, pmax = meta.dec_kv_idx.shape
            ps = batch.page_size
            flat = meta.dec_kv_idx.flatten()
            # One gather per layer; batch dims (KVH, B) stay contiguous, so the matmuls copy nothing.
            if meta.dec_k_buf is None:
                # Reused by every layer of this forward: a fresh multi-MB tensor per layer costs page
                # faults (glibc hands large blocks back to the OS) that took longer than the copy itself.
                meta.dec_k_buf = k_cache.new_empty(kvh, bd * pmax, ps * d)
                meta.dec_v_buf = v_cache.new_empty(kvh, bd * pmax, ps * d)
            # Per KV head, a dim-0 index_select of whole pages from a 2-D view: torch copies each row
            # with one memcpy there, ~1.7x faster than one index_select over dim 1 of the 4-D view.
            for h in range(kvh):
                torch.index_select(k_cache[h].view(-1, ps * d), 0, flat, out=meta.dec_k_buf[h])
                torch.index_select(v_cache[h].view(-1, ps * d), 0, flat, out=meta.dec_v_buf[h])
            kd = widen(meta.dec_k_buf, q.dtype).view(kvh, bd, pmax * ps, d)
            vd = widen(meta.dec_v_buf, q.dtype).view(kvh, bd, pmax * ps, d)
            if bd == 1:
                # One sequence: no padding, so SDPA needs no mask, and for one query row it is ~3x
                # faster than the two matmuls in bf16 (which win from a handful of rows up).
                # The group's query heads share their KV head, so they go in as a "sequence" of
                # `group` queries that all see every key: no GQA expansion (a copy of K and V).
                n = meta.dec_len0
                qd = (q if only_decodes else q[meta.dec_tok]).view(1, kvh, group, d)
                o = F.scaled_dot_product_attention(
                    qd, kd[:, :, :n].transpose(0, 1), vd[:, :, :n].transpose(0, 1), scale=self.scale
                )
                if only_decodes:
                    return o.reshape(1, self.num_heads * d)
                out[meta.dec_tok] = o.view(1, self.num_heads, d)
            else:
                qd = (
                    (q if only_decodes else q[meta.dec_tok]).view(bd, kvh, group, d).transpose(0, 1)
                )  # [KVH, B, G, D]
                scores = torch.matmul(qd, kd.transpose(-1, -2)).float() * self.scale + meta.dec_mask
                probs = torch.softmax(scores, dim=-1).to(vd.dtype)
                o = torch.matmul(probs, vd)  # [KVH, B, G, D]
                if only_decodes:
                    return o.permute(1, 0, 2, 3).reshape(bd, self.num_heads * d)
                out[meta.dec_tok] = o.permute(1, 0, 2, 3).reshape(bd, self.num_heads, d)
        if meta.sparse is not None:
            self.sparse_decode(layer, q, k, v, kv_buffer, batch, out, meta.sparse)
        self.extend(out, q, k_cache, v_cache, meta.ext, k, v)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


# The forward of a compiled graph cannot take a Python batch description, so the attention op finds
# its backend, KV buffer and batch here, under the handle of the model that is running (as vLLM's
# forward context). One entry per model instance; set only for the duration of one forward.
_CONTEXTS: dict[int, tuple[AttentionBackend, KVBuffer, ForwardBatch, Any]] = {}
_next_handle = itertools.count(1)


# cuDNN's attention, torch's first choice for SDPA on Hopper GPUs, builds an execution plan for each
# new shape; a decode's KV length is new at every step, so every step paid for a plan (measured on an
# H200: one stream at 10.7 tok/s, ~93 ms a token, and ~17 ms once every length had been seen). The
# flash and memory-efficient kernels take any length as it comes (and fp32 never used cuDNN).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels a forward on ``device`` may use (torch's own choice off CUDA)."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def new_handle() -> int:
    return next(_next_handle)


@contextlib.contextmanager
def attention_context(
    handle: int, backend: AttentionBackend, kv_buffer: KVBuffer, batch: ForwardBatch, connector=None
):
    """``connector``: a KV connector's worker side, told per layer (load before, save after)."""
    _CONTEXTS[handle] = (backend, kv_buffer, batch, connector)
    try:
        yield
    finally:
        del _CONTEXTS[handle]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, handle: int
) -> torch.Tensor:
    """Store k/v of ``layer`` into the KV pool and attend, with the context of model ``handle``.
    Eager forwards call the backend directly (the custom op's dispatch costs ~0.1 ms a call)."""
    if torch.compiler.is_compiling():
        return _attention_op(q, k, v, layer, handle)
    return _attend(q, k, v, layer, handle)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, handle: int) -> torch.Tensor:
    backend, kv_buffer, batch, connector = _CONTEXTS[handle]
    if connector is None:
        return backend.forward(layer, q, k, v, kv_buffer, batch)
    connector.wait_for_layer_load(layer)
    out = backend.forward(layer, q, k, v, kv_buffer, batch)
    connector.save_kv_layer(layer, kv_buffer)
    return out


@torch.library.custom_op("kvledger::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, handle: int) -> torch.Tensor:
    """``paged_attention`` inside compiled graphs. Opaque to ``torch.compile``: the KV pool is written
    as a side effect the compiler does not see, which is safe because nothing else in the graph reads
    it and each layer's call depends on the previous layer's output."""
    return _attend(q, k, v, layer, handle)


@_attention_op.register_fake
def _(q, k, v, layer, handle):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
