"""Weights served from a GGUF file's own blocks by ``kvledger_cpu::gguf_linear`` (``GgufWeight``):
the kinds the kernel reads as stored, the kinds the load-time repack interleaves, and the weight
that holds a layer's blocks (the file's order, or the repack's: the same bits)."""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import numpy as np
import torch

# The GGML types ``kvledger_cpu::gguf_linear`` reads as stored (``csrc/gguf_blocks.h``).
GGUF_KERNEL_KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
# Kinds the load-time repack interleaves (csrc/gguf_blocks.h): the GGML id + GGUF_PACKED is the kernel's
# kind for the repacked bytes.
GGUF_REPACK_KINDS = ("Q4_K", "Q6_K", "Q8_0", "Q5_0")
GGUF_PACKED = 100


@dataclass
class GgufWeight:
    """A layer served from a GGUF file's own blocks by ``kvledger_cpu::gguf_linear``: ``w`` holds the
    blocks of every output row, uint8, rows contiguous (for one tensor, a view of the file's memory
    map: no copy, no dequantization, no second rounding). ``parts``: ``(kind, rows)`` stacked along
    the outputs, more than one where a fused projection's parts are stored in different kinds (a
    Q4_K_M file's q/k in Q4_K or Q5_0 beside a v in Q6_K or Q8_0): each part runs in its own kind.
    Shares ``PackedWeight``'s attribute names, so the one-call decode takes it as one more
    projection: ``bits`` is minus the first part's GGML type id (``decode_layers`` dispatches on the
    sign) and ``scales`` the parts as ``[S, 2]`` int64 (empty for one part)."""

    parts: tuple[tuple[str, int], ...]
    in_features: int
    w: torch.Tensor
    wsum128: None = None
    amx_rows: int = 0  # never on AMX tiles
    # Calls of this many rows and more take the kernel's tiles' path (-1: its default, 0: never, one
    # order of sums a row whatever the batch: deterministic inference).
    tile_rows: int = -1
    # ``w`` holds the load-time repack (``repack``): every part's rows interleaved 16 at a time, the same
    # bits in another order; the kernel's kind is the GGML id + GGUF_PACKED.
    packed: bool = False
    scales: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self._set_scales()

    def _set_scales(self) -> None:
        ids = [[self._id(kind), rows] for kind, rows in self.parts]
        self.scales = torch.tensor(ids if len(ids) > 1 else [], dtype=torch.int64).reshape(-1, 2)

    def _id(self, kind: str) -> int:
        return int(gguf.GGMLQuantizationType[kind]) + (GGUF_PACKED if self.packed else 0)

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.parts)

    @property
    def bits(self) -> int:
        return -self._id(self.parts[0][0])

    def repackable(self) -> bool:
        """Whether ``repack`` applies: every part of a kind it interleaves, whole blocks along K (the
        K-quants' super-blocks of 256, Q8_0/Q5_0's blocks of 32)."""
        return (
            not self.packed
            and all(kind in GGUF_REPACK_KINDS for kind, _ in self.parts)
            and all(
                self.in_features % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0] == 0
                for kind, _ in self.parts
            )
        )

    def repack(self) -> None:
        """Interleave ``w`` in place of the file's order (``kvledger_cpu::gguf_repack``, over the
        threads): the one-row kernel then advances 16 outputs a SIMD lane each, its nibbles unpacked in
        registers, instead of decoding each row to int8 codes first; the bytes stay the file's (Q6_K,
        Q8_0 and Q5_0 exactly, Q4_K +2.8%: its 6-bit scales a byte each; parts padded to whole groups
        of 16 rows).
        ``w`` is only read: the file's pages it viewed are dropped once the model is built
        (``loader.release_file_pages``)."""
        if not self.repackable():
            raise ValueError(f"parts {self.parts} with {self.in_features} inputs have no repack")
        segs = torch.tensor(
            [[int(gguf.GGMLQuantizationType[k]), r] for k, r in self.parts], dtype=torch.int64
        )
        self.w = torch.ops.kvledger_cpu.gguf_repack([self.w], segs, self.in_features, False)
        self.packed = True
        self._set_scales()

    def file_blocks(self) -> torch.Tensor:
        """The file's bytes of every row (``w`` itself, or the repack undone: the same bytes exactly)."""
        if not self.packed:
            return self.w
        segs = torch.tensor([[self._id(k), r] for k, r in self.parts], dtype=torch.int64)
        return torch.ops.kvledger_cpu.gguf_repack([self.w], segs, self.in_features, True)

    def _group_rows(self, index: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """A repacked single part: the file's bytes of the groups of 16 holding ``index``'s rows, and
        where each asked row is among them (an embedding look-up unpacks a few groups, not the table)."""
        kind, rows = self.parts[0]
        idx = index.reshape(-1).long()
        groups, pos = torch.unique(torch.div(idx, 16, rounding_mode="floor"), return_inverse=True)
        gbytes = self.w.numel() // ((rows + 15) // 16)
        flat = self.w.reshape(-1)
        sel = torch.cat([flat[int(g) * gbytes : (int(g) + 1) * gbytes] for g in groups])
        n = 16 * len(groups)
        segs = torch.tensor([[self._id(kind), n]], dtype=torch.int64)
        raw = torch.ops.kvledger_cpu.gguf_repack([sel.contiguous()], segs, self.in_features, True)
        return raw.numpy().reshape(n, -1), pos * 16 + idx % 16

    def nbytes(self) -> int:
        return self.w.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvledger_cpu.gguf_linear(
            x, self.w, -self.bits, self.out_features, self.in_features, self.scales, self.tile_rows
        )

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``index`` (all when None) in float32, as ``gguf.quants.dequantize`` computes them."""
        if self.packed and len(self.parts) == 1 and index is not None:
            raw, where = self._group_rows(index)
            kind = gguf.GGMLQuantizationType[self.parts[0][0]]
            w = gguf.quants.dequantize(np.ascontiguousarray(raw[where.numpy()]), kind)
            return torch.from_numpy(np.asarray(w, dtype=np.float32)).reshape(-1, self.in_features)
        out, start, flat = [], 0, self.file_blocks().reshape(-1)
        for kind, rows in self.parts:
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            size = rows * self.in_features // block * nbytes
            raw = flat[start : start + size].numpy().reshape(rows, -1)
            start += size
            if len(self.parts) == 1 and index is not None:
                raw, index = raw[index.reshape(-1).numpy()], None  # only the rows asked for
            w = gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[kind])
            out.append(torch.from_numpy(np.asarray(w, dtype=np.float32)).reshape(-1, self.in_features))
        w = torch.cat(out) if len(out) > 1 else out[0]
        return w if index is None else w[index.reshape(-1)]
