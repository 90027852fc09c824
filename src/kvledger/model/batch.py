"""The description of one forward pass: which requests bring which tokens, and where their KV goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    """One forward over a mixed batch.

    Each request brings ``extend_lens[i]`` new tokens (a prefill chunk, or 1 for a decode) that start at
    position ``prefix_lens[i]`` of its sequence; ``seq_lens[i] = prefix_lens[i] + extend_lens[i]``.
    Token ``t`` of the flat batch is written to cache location ``out_loc[t]``; a request's whole
    sequence lives in the locations ``req_to_token[req_rows[i], :seq_lens[i]]``.
    """

    input_ids: torch.Tensor  # [T] int64, the new tokens of all requests, request after request
    positions: torch.Tensor  # [T] int64
    out_loc: torch.Tensor  # [T] int64, cache location of each new token
    req_rows: list[int]  # request-slot row of each request
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    logit_index: torch.Tensor  # [R] int64, flat positions whose hidden state goes through the LM head
    req_to_token: torch.Tensor  # [slots, max_context] int64, the request-slot table (shared, not copied)
    page_size: int = 1  # locations come in pages of this many tokens (page p = p*ps ...)
    # [P] int64, flat positions whose final-norm hidden state is returned too (pooling); None: none.
    pool_index: torch.Tensor | None = None
    # HiSparse (model/hisparse.py): the SparseWorker, and the request slots whose decode attends sparsely.
    sparse_worker: Any = None
    sparse_rows: frozenset[int] = frozenset()
    attn_meta: Any = field(default=None)  # filled by the attention backend's prepare()
    # The LoRA adapter of each row (``lora.LoraBatch``: rows grouped per adapter); None: all base model.
    lora: Any = None
    # Images (``multimodal/``): the flat positions of image tokens in this forward, and the encoded
    # embeddings that replace theirs ([len(mm_index), hidden]); None: a text-only forward.
    mm_index: torch.Tensor | None = None
    mm_rows: torch.Tensor | None = None
    # M-RoPE (``multimodal/mrope.py``): each token's (temporal, height, width) positions [3, T] where
    # a row of this forward meets an image; None: ``positions`` alone (each token's three equal).
    mrope_positions: torch.Tensor | None = None

    def to(self, device: torch.device) -> ForwardBatch:
        """The host-built index tensors moved to the model's device (``req_to_token`` lives there)."""
        if device.type == "cpu":
            return self
        for name in (
            "input_ids", "positions", "out_loc", "logit_index", "pool_index", "mm_index", "mm_rows", "mrope_positions",
        ):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device, non_blocking=True))
        return self

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
