"""The vocabulary ends: the token embedding (vocab-parallel under TP, optionally scaled as Gemma's)
and the LM head (a ``Linear``; logits gathered across ranks, optionally soft-capped)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import Comm
from ...kernels.gguf_weight import GgufWeight
from ...kernels.quant import PackedWeight
from ..linear import Linear

_splice = threading.local()


@contextmanager
def spliced(index: torch.Tensor | None, rows: torch.Tensor | None) -> Iterator[None]:
    """Inside this block the embedding's output rows ``index`` (flat token positions) are ``rows``
    (an image's encoded embeddings in place of its placeholder tokens', ``multimodal/``); per thread,
    as the forward runs on one."""
    prev = getattr(_splice, "value", None)
    _splice.value = None if index is None else (index, rows)
    try:
        yield
    finally:
        _splice.value = prev


class VocabEmbedding(nn.Module):
    """A dense table, or a tied LM head's packed int8 or GGUF blocks (looked up row by row: no second copy
    of the largest matrix). Under TP this rank holds rows ``[vocab_start, + vocab_rows)``; the
    partial lookups are all-reduced. ``scale``: multiply the result (Gemma: sqrt(hidden))."""

    def __init__(
        self, table: torch.Tensor | PackedWeight | GgufWeight, dtype: torch.dtype, comm: Comm, scale: float | None = None
    ):
        super().__init__()
        packed = isinstance(table, (PackedWeight, GgufWeight))
        self.weight: torch.Tensor | PackedWeight | GgufWeight = (
            table if packed else nn.Parameter(table, requires_grad=False)
        )
        self.dtype = dtype
        self.comm = comm
        self.vocab_rows = table.out_features if packed else table.shape[0]
        self.vocab_start = comm.rank * self.vocab_rows
        self.scale = scale

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, (PackedWeight, GgufWeight)):
            return self.weight.rows(ids).to(self.dtype)
        return F.embedding(ids, self.weight)

    def densify(self, device: torch.device) -> None:
        """A dense table in place of packed blocks (``torch.compile`` traces ``F.embedding``)."""
        if isinstance(self.weight, (PackedWeight, GgufWeight)):
            self.weight = nn.Parameter(
                self.weight.rows().to(device=device, dtype=self.dtype), requires_grad=False
            )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if comm.size == 1:
            h = self._lookup(input_ids)
        else:
            local = input_ids - self.vocab_start
            inside = (local >= 0) & (local < self.vocab_rows)
            h = comm.all_reduce(self._lookup(local.clamp(0, self.vocab_rows - 1)) * inside.unsqueeze(-1))
        if self.scale is not None:
            # transformers multiplies by the scale held in the model dtype
            h = h * torch.tensor(self.scale, dtype=h.dtype)
        splice = getattr(_splice, "value", None)
        if splice is not None:  # after the scale: the vision features replace the scaled embeddings
            h = h.index_copy(0, splice[0], splice[1].to(h.dtype))
        return h


class LMHead(nn.Module):
    """float32 logits ``[rows, vocab]``; ``softcap``: ``cap * tanh(logits / cap)`` (Gemma 2)."""

    def __init__(self, linear: Linear, vocab_size: int, comm: Comm, softcap: float | None = None):
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.comm = comm
        self.softcap = softcap

    def greedy_in_kernel(self, rows: int) -> bool:
        """Whether ``greedy`` serves ``rows`` rows: the kernels' packed head (a tied Q8_0 embedding's
        own blocks, or a quantized head) or a head of one GGUF kind served as stored, where ``forward`` runs that kernel too (``Linear.path``: not
        the int8 or AMX copies, whose logits differ), on one rank, no soft-cap (its saturation can tie
        logits the raw ones do not), no adapter on the head, eager."""
        lin = self.linear
        return (
            lin.qw is not None
            # one kind for the whole head where it is a GGUF file's blocks as stored (head_argmax's)
            and not (isinstance(lin.qw, GgufWeight) and len(lin.qw.parts) > 1)
            and lin.path(rows) == "kernel"
            and self.comm.size == 1
            and self.softcap is None
            and lin.b is None
            and lin.lora is None
            and not torch.compiler.is_compiling()
        )

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row, int64 ``[rows]``: the head in C++ over chunks of the
        vocabulary on its stored blocks, the argmax kept as it goes (``kvledger_cpu::head_argmax``), no
        logits materialized; the same tokens as ``forward`` then ``max(dim).indices``. Needs
        ``greedy_in_kernel(rows)``."""
        q = self.linear.qw
        return torch.ops.kvledger_cpu.head_argmax(
            h.contiguous(),
            q.w,
            q.scales,
            q.wsum128,
            q.bits,
            q.out_features,
            min(self.vocab_size, q.out_features),
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.linear(h).float()
        if self.comm.size > 1:
            logits = self.comm.gather_vocab(logits)[:, : self.vocab_size]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
