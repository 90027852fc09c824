"""The ``cpu`` attention backend: decodes in kvledger's C++ kernel (``kernels/``), extends as the
torch backend does.

The kernel reads each request's K/V where it lies in the pool (through ``req_to_token``; no gather
copy), packs the query heads of one KV head so they share every K/V read, keeps an online softmax,
and splits long contexts over threads. In a forward of decodes only it also writes the new tokens'
K/V into their pages (one call per layer instead of two index writes and a gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..errors import ModelLoadError
from .attention import ATTENTION_BACKENDS, TorchAttention
from .batch import ForwardBatch


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: ``cpu`` (the C++ kernels) for bfloat16 on a CPU where they load, else ``torch``.
    float32 stays on ``torch`` unless asked: it is the token-exact reference path (the kernels sum in
    another order). ``cpu`` asked where it cannot run is an error, not a silent fallback."""
    if name not in ATTENTION_BACKENDS:
        raise ModelLoadError(
            f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}"
        )
    if name == "torch":
        return name
    usable = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if name == "cpu":
        if not usable:
            raise ModelLoadError(
                f"the cpu attention backend runs on CPUs in float32/bfloat16, not {device.type} {dtype}"
            )
        if not kernels.load():
            raise ModelLoadError(
                f"the cpu attention backend needs kvledger's C++ kernels: {kernels.status()}"
            )
        return name
    return "cpu" if usable and dtype == torch.bfloat16 and kernels.load() else "torch"


@dataclass
class _CpuMeta:
    dec_tok: torch.Tensor | None  # [Bd] flat token index of each decode
    dec_rows: torch.Tensor | None  # [Bd] request-slot rows
    dec_lens: torch.Tensor | None  # [Bd] sequence lengths (the new token included)
    ext: list  # as the torch backend's
    only_decodes: bool


class CpuAttention(TorchAttention):
    """Needs the kernels loaded (``kernels.load()``) and q, K/V of one dtype (float32 or bfloat16)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.op = torch.ops.kvledger_cpu.decode_attention

    def prepare(self, batch: ForwardBatch) -> None:
        dec_tok, rows, lens, ext = self.split(batch)
        if not dec_tok:
            batch.attn_meta = _CpuMeta(None, None, None, ext, False)
            return
        batch.attn_meta = _CpuMeta(
            torch.tensor(dec_tok),
            torch.tensor(rows, dtype=torch.int64),
            torch.tensor(lens, dtype=torch.int64),
            ext,
            not ext and len(dec_tok) == batch.num_tokens,
        )

    def forward(self, layer, q, k, v, kv_buffer, batch):
        k_cache, v_cache = kv_buffer.k[layer], kv_buffer.v[layer]
        meta: _CpuMeta = batch.attn_meta
        table = batch.req_to_token
        if meta.only_decodes:
            return self.op(
                q, k_cache, v_cache, table, meta.dec_rows, meta.dec_lens, self.scale, k, v, batch.out_loc
            )
        self.store(k_cache, v_cache, k, v, batch)
        out = torch.empty_like(q)
        if meta.dec_tok is not None:
            o = self.op(q[meta.dec_tok], k_cache, v_cache, table, meta.dec_rows, meta.dec_lens, self.scale)
            out[meta.dec_tok] = o.view(-1, self.num_heads, self.head_dim)
        self.extend(out, q, k_cache, v_cache, meta.ext)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
