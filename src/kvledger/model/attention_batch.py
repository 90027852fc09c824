"""One forward's requests by the attention they need (``BatchSplit``: decodes, extends for SDPA or
for a backend's kernel, HiSparse decodes), each request's span of keys, and the torch backend's
per-forward metadata built from them (``TorchMeta``, with the decode group's padded page index and
mask). The backends' ``prepare`` (``model/attention.py``, ``model/attention_cpu.py``) read the batch
through these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .batch import ForwardBatch


@dataclass
class TorchMeta:
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
    """One forward's requests by the attention they need (``split_batch``)."""

    dec_tok: list[int]  # decodes: flat token index,
    dec_rows: list[int]  # request-slot row,
    dec_lens: list[int]  # sequence length (the new token included)
    sdpa_ext: list  # extends for SDPA: (tok_start, n, kv_idx [S], mask [n, S] or None: plain causal)
    kernel_ext: list[list[int]]  # extends for a backend's kernel: [rows, tok_starts, prefixes, new tokens]
    # HiSparse decodes (``batch.sparse_rows``): flat token index, request-slot row, sequence length
    sparse: tuple[list[int], list[int], list[int]] = ((), (), ())  # type: ignore[assignment]


def split_batch(batch: ForwardBatch, in_kernel: Callable[[int, int], bool] | None = None) -> BatchSplit:
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
            sp.sdpa_ext.append(sdpa_extend(batch, row, start, pre, n))
        start += n
    return sp


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


def request_spans(batch: ForwardBatch) -> list[tuple[int, int, int, torch.Tensor]]:
    """``(tok_start, prefix, new, kv_idx [prefix + new])`` of every request of the batch."""
    out, start = [], 0
    for row, pre, n in zip(batch.req_rows, batch.prefix_lens, batch.extend_lens):
        if n:
            out.append((start, pre, n, batch.req_to_token[row, : pre + n]))
        start += n
    return out


def sparse_meta(sp: BatchSplit) -> tuple | None:
    tok, rows, lens = sp.sparse
    return (torch.tensor(tok), list(rows), list(lens)) if tok else None


def decode_group(meta: TorchMeta, batch: ForwardBatch, sp: BatchSplit) -> None:
    """The decode group of ``TorchAttention``'s forward: flat token indices, the padded page index of
    each decode and the additive mask over its padding, into ``meta``."""
    dec_tok, dec_rows, dec_lens = sp.dec_tok, sp.dec_rows, sp.dec_lens
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
    mask = torch.zeros(valid.shape, dtype=torch.float32, device=dev).masked_fill_(~valid, float("-inf"))
    meta.dec_mask = mask[None, :, None, :]  # broadcast over [KVH, B, G, L]
