"""Attention backends. The model calls ``prepare`` once per forward and ``forward`` once per layer.

A CUDA backend (flashinfer, triton) implements the same two methods and is chosen by name in
``make_backend`` (``attention_cpu.py``, beside the other backend it chooses between); the model code
does not change.

The reference backend's parts live beside it: ``attention_batch.py`` (the batch by the attention each
request needs, and the per-forward metadata), ``attention_extend.py`` (extends through SDPA),
``kv_cast.py`` (the pool's element type) and ``attention_context.py`` (how a layer finds the running
forward's backend, pool and batch).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .attention_batch import TorchMeta, decode_group, request_spans, sparse_meta, split_batch
from .attention_extend import attend_extends
from .batch import ForwardBatch
from .kv_cast import to_cache, widen


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

    def prepare(self, batch: ForwardBatch) -> None:
        sp = split_batch(batch)
        meta = TorchMeta(None, None, None, sp.sdpa_ext)
        meta.sparse = sparse_meta(sp)
        meta.special = self.special_layers(batch)
        if meta.special is not None:
            meta.spans = request_spans(batch)
        # Every layer attends by spans (a sliding-window model past its window): the decode group's
        # padded page index would go unused (it spans whole rows, out-of-window entries included:
        # memory/window.py), so it is not built.
        if sp.dec_tok and not (meta.special is not None and all(meta.special)):
            decode_group(meta, batch, sp)
        batch.attn_meta = meta

    def hisparse_in_place(self, worker) -> bool:
        """Whether HiSparse rows read the host pool in place (no hot-page copies): not here, the torch
        reference copies selected pages into ``hot[1:]``."""
        return False

    def sparse_decode(self, layer: int, q, k, v, kv_buffer, batch, out: torch.Tensor, sparse: tuple) -> None:
        """HiSparse rows (their new K/V already stored): the worker chooses and fills their pages, then
        attention reads those pages only; into ``out``'s rows (any shape with those rows first)."""
        tok, rows, lens = sparse[:3]
        worker = batch.sparse_worker
        pages, counts, in_host = worker.select(layer, q[tok], k[tok], v[tok], rows, lens, kv_buffer)
        if in_host:  # a dense layer: every page, from the host pool
            o = worker.attend_host_torch(q[tok], layer, pages, counts, self.scale)
        else:
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

    def forward(self, layer, q, k, v, kv_buffer, batch):
        k_cache, v_cache = kv_buffer.k[layer], kv_buffer.v[layer]  # [KVH, locations, D]
        k, v = self.store(k_cache, v_cache, k, v, batch)
        meta: TorchMeta = batch.attn_meta
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
        attend_extends(out, q, k_cache, v_cache, meta.ext, self.scale, k, v)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
