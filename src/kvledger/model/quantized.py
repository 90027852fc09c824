"""GGUF's quantized 2-D weights kept as the file stores them, until a layer takes them.

A Q4_1 or Q8_0 matrix (the two block formats kvledger's kernels run as they are: ``kernels/quant.py``)
is a ``BlockWeight``: its raw blocks of 32 along the input dimension, a view of the file's memory map
until something needs more. The model packs them straight into the kernel's layout — no float copy
of the model, no re-quantization — and everything else (float32 reference, torch's kernels, CUDA)
asks for ``dequantize()``, which computes what ``gguf.quants.dequantize`` computes, bit for bit.

Block layouts (llama.cpp's ``ggml-common.h``):
- Q4_1: ``d`` (fp16), ``m`` (fp16), 16 bytes of codes: byte j holds element j (low nibble) and
  element j + 16 (high nibble); ``w = d * q + m``.
- Q8_0: ``d`` (fp16), 32 int8 codes; ``w = d * q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
BLOCK_KINDS = tuple(BLOCK_BYTES)


@dataclass(frozen=True)
class BlockWeight:
    """A ``[rows, cols]`` weight as GGUF blocks: ``raw`` is ``[rows, cols / 32, block bytes]`` uint8."""

    kind: str  # Q4_1 | Q8_0
    raw: np.ndarray

    @classmethod
    def from_gguf(cls, kind: str, data: np.ndarray) -> BlockWeight:
        """``data``: the reader's ``[rows, row bytes]`` uint8 view of one tensor (not copied)."""
        rows = data.shape[0]
        return cls(kind, data.reshape(rows, -1, BLOCK_BYTES[kind]))

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.raw.shape[1] * GROUP

    @property
    def bits(self) -> int:
        return 4 if self.kind == "Q4_1" else 8

    def nbytes(self) -> int:
        return self.raw.size

    # -- selections (all in whole blocks; the raw bytes are copied only by ``cat``) ---------------------
    def rows(self, index: slice | torch.Tensor | np.ndarray) -> BlockWeight:
        """Rows ``index`` (a slice, or a permutation / selection of row numbers)."""
        if isinstance(index, torch.Tensor):
            index = index.numpy()
        return BlockWeight(self.kind, self.raw[index])

    def cols(self, index: slice) -> BlockWeight | None:
        """Columns ``index`` (a step-1 slice); None unless it starts and ends on block boundaries."""
        start, stop, step = index.indices(self.shape[1])
        if step != 1 or start % GROUP or stop % GROUP:
            return None
        return BlockWeight(self.kind, self.raw[:, start // GROUP : stop // GROUP])

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Stacked along rows (a fused QKV or gate/up projection); all of one kind."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack blocks of kinds {sorted(kinds)}")
        return BlockWeight(parts[0].kind, np.concatenate([p.raw for p in parts]))

    def pad_rows(self, rows: int) -> BlockWeight:
        """Zero rows appended up to ``rows`` (all-zero blocks stand for zero weights in both kinds)."""
        extra = rows - self.shape[0]
        if extra <= 0:
            return self
        zeros = np.zeros((extra, *self.raw.shape[1:]), dtype=np.uint8)
        return BlockWeight(self.kind, np.concatenate([self.raw, zeros]))

    # -- what the blocks hold ------------------------------------------------------------------------------
    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q [rows, cols], d [rows, cols/32] fp16, m or None)``: Q4_1 codes 0..15 as uint8 (``m`` its
        fp16 minimum), Q8_0 codes as int8 (``m`` None)."""
        raw = np.ascontiguousarray(self.raw)
        n, g, _ = raw.shape
        d = torch.from_numpy(np.ascontiguousarray(raw[..., 0:2]).view(np.float16).reshape(n, g))
        if self.kind == "Q4_1":
            m = torch.from_numpy(np.ascontiguousarray(raw[..., 2:4]).view(np.float16).reshape(n, g))
            qs = raw[..., 4:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, g * GROUP)
            return torch.from_numpy(q), d, m
        q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, g * GROUP)
        return torch.from_numpy(q), d, None

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]``: ``d * q (+ m)`` in float32, as ``gguf.quants.dequantize``."""
        q, d, m = self.codes()
        n, k = q.shape
        w = q.view(n, k // GROUP, GROUP).float() * d.float()[..., None]
        if m is not None:
            w = w + m.float()[..., None]
        return w.view(n, k)


Weight = torch.Tensor | BlockWeight
"""A loaded weight: a float tensor, or a quantized matrix kept as the file's blocks."""


def dense(w: Weight) -> torch.Tensor:
    """The weight as a float tensor (float32 for blocks; tensors as they are)."""
    return w.dequantize() if isinstance(w, BlockWeight) else w


def select_rows(w: Weight, index: slice) -> Weight:
    """Rows ``index`` of a weight, kept as blocks where it is blocks (a fused tensor split)."""
    return w.rows(index) if isinstance(w, BlockWeight) else w[index]


def cat_rows(parts: list[Weight]) -> Weight:
    """Weights stacked along rows, kept as blocks when every part is blocks of one kind."""
    if all(isinstance(p, BlockWeight) for p in parts) and len({p.kind for p in parts}) == 1:
        return BlockWeight.cat(parts)
    return torch.cat([dense(p) for p in parts])
