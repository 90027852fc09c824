"""GGUF's quantized 2-D weights kept as the file stores them, until a layer takes them.

A matrix in one of the block formats kvledger's kernels read (``FORMATS``: Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL) is a ``BlockWeight``: its raw blocks along the input dimension (32
elements, or 256 for the K-quants), a view of the file's memory map until something needs more. A
quantized ``Linear`` serves Q4_1 and Q8_0 packed into the VNNI kernel's layout (``kernels/quant.py``:
its own codes and scales, no re-quantization) and every other kind straight from these bytes
(``kernels/gguf_weight.GgufWeight``, ``kvledger_cpu::gguf_linear``): no float copy of the model, no
second rounding. Everything else (float32 reference, torch's kernels, CUDA) asks for
``dequantize()``, which computes what ``gguf.quants.dequantize`` computes, bit for bit.

Block layouts: llama.cpp's ``ggml-common.h``, summarized in ``kernels/csrc/gguf_blocks.h``; the two
packed ones:
- Q4_1: ``d`` (fp16), ``m`` (fp16), 16 bytes of codes: byte j holds element j (low nibble) and
  element j + 16 (high nibble); ``w = d * q + m``.
- Q8_0: ``d`` (fp16), 32 int8 codes; ``w = d * q``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import gguf
import numpy as np
import torch

GROUP = 32
FORMATS = {  # kind: (elements a block, bytes a block)
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18),
}  # fmt: skip
BLOCK_KINDS = tuple(FORMATS)
PACKED_BITS = {"Q4_1": 4, "Q8_0": 8}
"""The kinds the Q4_1/Q8_0 kernel (``kernels/quant.py``) packs as they are, and its width for each."""


@dataclass(frozen=True)
class BlockWeight:
    """A ``[rows, cols]`` weight as GGUF blocks: ``raw`` is ``[rows, cols / block, block bytes]`` uint8.

    ``heads`` > 0: ``stored`` holds the rows in llama.cpp's q/k order for that many heads (its Llama
    converter interleaves each head's two rotary halves) and the weight's rows are HF's (``raw`` puts
    them back, a copy made once, on first use); the load-time repack reads the stored order directly
    (``kvledger_cpu::gguf_repack``'s heads column), so a repacked q/k projection never pays that copy."""

    kind: str  # one of BLOCK_KINDS
    stored: np.ndarray
    heads: int = 0

    @classmethod
    def from_gguf(cls, kind: str, data: np.ndarray) -> BlockWeight:
        """``data``: the reader's ``[rows, row bytes]`` uint8 view of one tensor (not copied)."""
        rows = data.shape[0]
        return cls(kind, data.reshape(rows, -1, FORMATS[kind][1]))

    @cached_property
    def raw(self) -> np.ndarray:
        """The blocks in the weight's row order (``stored`` itself unless ``heads``)."""
        if not self.heads:
            return self.stored
        n = self.stored.shape[0]
        order = np.arange(n).reshape(self.heads, n // self.heads // 2, 2).transpose(0, 2, 1).reshape(n)
        return self.stored[order]

    def interleaved(self, heads: int) -> BlockWeight:
        """These rows read as llama.cpp's q/k order for ``heads`` heads (``unpermute_qk``): no copy."""
        if self.heads:
            raise ValueError("the rows are already read as an interleaved q/k order")
        return BlockWeight(self.kind, self.stored, heads)

    @property
    def block(self) -> int:
        """Elements a block along the input dimension (32, or 256 for the K-quants)."""
        return FORMATS[self.kind][0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.stored.shape[0], self.stored.shape[1] * self.block

    @property
    def bits(self) -> int:
        """The packed kernel's width for Q4_1 (4) and Q8_0 (8); 0 for the kinds served as stored."""
        return PACKED_BITS.get(self.kind, 0)

    def nbytes(self) -> int:
        return self.stored.size

    # -- selections (all in whole blocks; the raw bytes are copied only by ``cat``) ---------------------
    def rows(self, index: slice | torch.Tensor | np.ndarray) -> BlockWeight:
        """Rows ``index`` (a slice, or a permutation / selection of row numbers); whole heads of an
        interleaved q/k order stay a view (a tensor-parallel shard)."""
        if isinstance(index, torch.Tensor):
            index = index.numpy()
        if self.heads and isinstance(index, slice):
            rph = self.stored.shape[0] // self.heads
            start, stop, step = index.indices(self.stored.shape[0])
            if step == 1 and start % rph == 0 and stop % rph == 0 and stop > start:
                return BlockWeight(self.kind, self.stored[start:stop], (stop - start) // rph)
        return BlockWeight(self.kind, self.raw[index])

    def cols(self, index: slice) -> BlockWeight | None:
        """Columns ``index`` (a step-1 slice); None unless it starts and ends on block boundaries."""
        start, stop, step = index.indices(self.shape[1])
        b = self.block
        if step != 1 or start % b or stop % b:
            return None
        return BlockWeight(self.kind, self.stored[:, start // b : stop // b], self.heads)

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Stacked along rows (a fused QKV or gate/up projection); all of one kind."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack blocks of kinds {sorted(kinds)}")
        return BlockWeight(parts[0].kind, np.concatenate([p.raw for p in parts]))

    def pad_rows(self, rows: int) -> BlockWeight:
        """Zero rows appended up to ``rows`` (an all-zero block is zero weights in every kind: its
        scales are zero)."""
        extra = rows - self.shape[0]
        if extra <= 0:
            return self
        zeros = np.zeros((extra, *self.raw.shape[1:]), dtype=np.uint8)
        return BlockWeight(self.kind, np.concatenate([self.raw, zeros]))

    # -- what the blocks hold ------------------------------------------------------------------------------
    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q [rows, cols], d [rows, cols/32] fp16, m or None)``: Q4_1 codes 0..15 as uint8 (``m`` its
        fp16 minimum), Q8_0 codes as int8 (``m`` None). Only for those two kinds (``PACKED_BITS``)."""
        if self.kind not in PACKED_BITS:
            raise ValueError(f"codes() reads Q4_1 and Q8_0 blocks, not {self.kind}")
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
        """float32 ``[rows, cols]``, as ``gguf.quants.dequantize`` computes it (Q4_1/Q8_0 in torch:
        ``d * q (+ m)`` in float32, the same bits)."""
        if self.kind not in PACKED_BITS:
            flat = np.ascontiguousarray(self.raw).reshape(self.raw.shape[0], -1)
            w = gguf.quants.dequantize(flat, gguf.GGMLQuantizationType[self.kind])
            return torch.from_numpy(np.asarray(w, dtype=np.float32)).reshape(self.shape)
        q, d, m = self.codes()
        n, k = q.shape
        w = q.view(n, k // GROUP, GROUP).float() * d.float()[..., None]
        if m is not None:
            w = w + m.float()[..., None]
        return w.view(n, k)


@dataclass(frozen=True)
class BlockStack:
    """Block weights of different kinds stacked along rows: a fused projection whose parts the file
    stores in different kinds (Gemma 3's Q4_K_M: q and k in Q5_0, v in Q8_0). A quantized ``Linear``
    runs each part in its own kind in one call (``GgufWeight.parts``), so no part is re-quantized to a
    common one and the fused decode keeps one projection; ``dequantize()`` stacks the parts'."""

    parts: tuple[BlockWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


Weight = torch.Tensor | BlockWeight | BlockStack
"""A loaded weight: a float tensor, or a quantized matrix kept as the file's blocks (one kind, or
a fused stack of kinds)."""


def dense(w: Weight) -> torch.Tensor:
    """The weight as a float tensor (float32 for blocks; tensors as they are)."""
    return w.dequantize() if isinstance(w, (BlockWeight, BlockStack)) else w


def select_rows(w: Weight, index: slice) -> Weight:
    """Rows ``index`` of a weight, kept as blocks where it is blocks (a fused tensor split)."""
    return w.rows(index) if isinstance(w, BlockWeight) else dense(w)[index]


def cat_rows(parts: list[Weight], apart: bool = False) -> Weight:
    """Weights stacked along rows, kept as blocks when every part is blocks: one kind stacked into
    one ``BlockWeight``, several into a ``BlockStack`` (each part served in its own kind). ``apart``:
    one kind's parts too are left a ``BlockStack`` (views of the file), for a layer the load-time repack
    reads part by part into its own buffer: a concatenated copy first would only be thrown away."""
    if all(isinstance(p, BlockWeight) for p in parts):
        if len({p.kind for p in parts}) == 1 and not apart:
            return BlockWeight.cat(parts)
        if len({p.shape[1] for p in parts}) == 1:
            return BlockStack(tuple(parts))
    return torch.cat([dense(p) for p in parts])
