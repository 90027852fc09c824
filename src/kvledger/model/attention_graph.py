"""The attention backend of a captured decode step (``engine/graph_runner.py``): fixed shapes and no
host values, so that the step can be a CUDA graph.

Every row brings one token. Its K/V go to ``batch.out_loc`` (computed inside the step from the page
table), then it attends over its first ``seq_lens[b]`` tokens read in place through its line of the
request->token table (``req_to_token[rows[b]]``). Two implementations of the same arithmetic:
``triton`` (``kernels/triton_decode.py``: the length is read inside the kernel, one launch for any
lengths) on CUDA, and ``torch`` (``decode_torch``: every row over the table's whole width, masked
past its length) for the CPU stand-in the tests capture with. No sliding window or soft-capping
(those steps run eager).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import triton_decode
from .attention import KVBuffer, TorchAttention
from .batch import ForwardBatch

KERNELS = ("triton", "torch")


@dataclass
class GraphDecodeMeta:
    """``batch.attn_meta`` of a captured step: views of the runner's static buffers."""

    rows: torch.Tensor  # [bs] int64, each row's line of the request->token table
    seq_lens: torch.Tensor  # [bs] int64, tokens to attend (the new one included), >= 1


def decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``triton_decode.decode`` in fixed-shape torch ops: ``q`` ``[B, H, D]``, caches ``[KVH, L, D]``;
    ``[B, H * D]``. Gathers the whole width of each row's table line (a fixed shape, whatever the
    lengths) and masks the tokens past ``seq_lens``."""
    B, H, D = q.shape
    kvh = k_cache.shape[0]
    locs = table.index_select(0, rows)  # [B, W]
    W = locs.shape[1]
    flat = locs.flatten()
    ke = k_cache.index_select(1, flat).view(kvh, B, W, D)
    ve = v_cache.index_select(1, flat).view(kvh, B, W, D)
    qd = q.view(B, kvh, H // kvh, D).transpose(0, 1)  # [KVH, B, G, D]
    scores = torch.matmul(qd, ke.transpose(-1, -2)).float() * scale  # [KVH, B, G, W]
    valid = torch.arange(W, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, W]
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1).to(ve.dtype), ve)  # [KVH, B, G, D]
    return o.permute(1, 0, 2, 3).reshape(B, H * D)


class GraphDecodeAttention:
    """``AttentionBackend`` of captured decode steps; ``prepare`` has nothing to do (the runner puts
    a ``GraphDecodeMeta`` in ``batch.attn_meta``)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, kernel: str):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kernel = kernel

    def prepare(self, batch: ForwardBatch) -> None:
        pass

    def forward(self, layer, q, k, v, kv_buffer: KVBuffer, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = kv_buffer.k[layer], kv_buffer.v[layer]
        TorchAttention.store(k_cache, v_cache, k, v, batch)
        meta: GraphDecodeMeta = batch.attn_meta
        attend = triton_decode.decode if self.kernel == "triton" else decode_torch
        return attend(q, k_cache, v_cache, batch.req_to_token, meta.rows, meta.seq_lens, self.scale)
