"""Weights for ``kvledger_cpu::quant_linear``: GGUF-style blocks of 32 along the input dimension,
packed 16 output rows at a time (the layout is described in ``csrc/qlinear.h``).

- ``int4`` is Q4_1: ``w = d * q + m`` with ``q`` in 0..15 and the block's min and max mapping to codes 0
  and 15. Quantizing weights dequantized from a Q4_1 file recovers the file's own codes, and its fp16
  ``d`` and ``m``.
- ``int8`` is Q8_0: ``w = d * q`` with ``q`` in -127..127 and ``d = max|w| / 127``; the same holds for a
  Q8_0 file (SmolLM2's embedding and tied LM head).

Activations are quantized to int8 per block of 32 inside the op (as llama.cpp does for these formats);
the error that adds is measured in tests/unit/test_quant_linear.py and docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import has_amx, load, quant_isa

GROUP = 32
ROWS = 16  # output rows per block: one int32 lane each in the kernel
FP16_MAX = 65504.0


@dataclass
class PackedWeight:
    """One quantized linear layer as the op reads it."""

    bits: int
    out_features: int
    in_features: int
    w: torch.Tensor  # uint8 (int4, two codes a byte) or int8
    scales: torch.Tensor  # fp16
    wsum128: torch.Tensor | None  # int32, int8 only
    amx_rows: int = 0
    """Calls of at least this many bf16 rows run on AMX tiles where the CPU has them (the weights
    dequantized to bf16 in the call, float sums; ``model/linear.AMX_TILE_ROWS``); 0: never."""

    def nbytes(self) -> int:
        extra = 0 if self.wsum128 is None else self.wsum128.numel() * 4
        return self.w.numel() * self.w.element_size() + self.scales.numel() * 2 + extra

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvledger_cpu.quant_linear(
            x, self.w, self.scales, self.wsum128, self.bits, self.out_features, self.amx_rows
        )

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``index`` (all rows when None) of the weights this stands for, in float32: ``d * q
        (+ m)`` per block of 32, computed as ``gguf.quants.dequantize`` does (so a Q8_0 embedding
        looked up here equals the file's, bit for bit)."""
        n, k, g = self.out_features, self.in_features, self.in_features // GROUP
        nb = n // ROWS
        if index is None:
            index = torch.arange(n)
        blk, lane = index // ROWS, index % ROWS
        if self.bits == 4:
            # [NB, K/8, 16 rows, 4] bytes; byte j of a chunk: element j (low), j + 4 (high)
            b = self.w.view(nb, k // 8, ROWS, 4)[blk, :, lane]  # [T, K/8, 4]
            q = torch.stack([b & 0x0F, b >> 4], dim=-2).view(-1, k)
            sc = self.scales.view(nb, g, 2, ROWS)
            d, m = sc[blk, :, 0, lane], sc[blk, :, 1, lane]  # [T, G]
        else:
            q = self.w.view(nb, k // 4, ROWS, 4)[blk, :, lane].reshape(-1, k)
            d, m = self.scales.view(nb, g, ROWS)[blk, :, lane], None
        w = q.view(-1, g, GROUP).float() * d.float()[..., None]
        if m is not None:
            w = w + m.float()[..., None]
        return w.view(-1, k)


def packable(w: torch.Tensor) -> bool:
    """The kernel takes whole blocks: out_features a multiple of 16, in_features of 32."""
    return w.dim() == 2 and w.shape[0] % ROWS == 0 and w.shape[1] % GROUP == 0 and w.device.type == "cpu"


def q4_1(
    w: torch.Tensor, scale_dtype: torch.dtype | None = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks: ``(q [N, K] int32 in 0..15, d [N, K/32], m [N, K/32])`` with ``w ~= d*q + m``;
    ``d`` and ``m`` are rounded to ``scale_dtype`` first (fp16: the file's precision; None: kept in
    float32), the codes chosen against them."""
    n, k = w.shape
    wf = w.float().view(n, k // GROUP, GROUP)
    lo, hi = wf.amin(-1), wf.amax(-1)
    d, m = (hi - lo) / 15, lo
    if scale_dtype is not None:
        d, m = d.to(scale_dtype).float(), m.to(scale_dtype).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((wf - m[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.int32)
    return q.view(n, k), d, m


def q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks: ``(q [N, K] int8 in -127..127, d [N, K/32])`` with ``w ~= d*q``."""
    n, k = w.shape
    wf = w.float().view(n, k // GROUP, GROUP)
    d = (wf.abs().amax(-1) / 127).half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(wf / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, k), d


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """Per-(row, group) values ``[N, G]`` as ``[N/16, G, 16]``: one register per (row block, group)."""
    n, g = t.shape
    return t.view(n // ROWS, ROWS, g).transpose(1, 2)


def pack(w: torch.Tensor, bits: int) -> PackedWeight | None:
    """Quantize and pack ``w [N, K]``; None when the shape or the scales' range does not fit."""
    if not packable(w):
        return None
    if bits == 4:
        return pack_blocks(*q4_1(w), bits=4)
    if bits == 8:
        return pack_blocks(*q8_0(w), None, bits=8)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def pack_blocks(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int
) -> PackedWeight | None:
    """Pack blocks as they are: ``q [N, K]`` codes (0..15 for 4 bits, -127..127 for 8), ``d`` (and 4
    bits' ``m``) ``[N, K/32]``, exactly representable in fp16 (a GGUF file's own fields are). None when
    the shape is not whole blocks of 16 rows x 32 or a scale is out of fp16's range."""
    n, k = q.shape
    if n % ROWS or k % GROUP or q.device.type != "cpu":
        return None
    nb = n // ROWS
    if bits == 4:
        if max(d.abs().max().item(), m.abs().max().item()) > FP16_MAX:
            return None
        # [NB, 16 rows, K/8 chunks, 2 halves, 4] -> [NB, K/8, 16, 4, 2]: low nibble = first half
        v = q.view(nb, ROWS, k // 8, 2, 4).permute(0, 2, 1, 4, 3).to(torch.uint8)
        packed = (v[..., 0] | (v[..., 1] << 4)).contiguous().view(-1)
        scales = torch.stack([_blocks(d), _blocks(m)], dim=2).half().contiguous().view(-1)
        return PackedWeight(4, n, k, packed, scales, None)
    if bits == 8:
        if d.float().abs().max().item() > FP16_MAX:
            return None
        q = q.to(torch.int8)
        packed = q.view(nb, ROWS, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(-1)
        wsum = q.view(n, k // GROUP, GROUP).sum(-1, dtype=torch.int32) * 128
        return PackedWeight(
            8, n, k, packed, _blocks(d).half().contiguous().view(-1), _blocks(wsum).contiguous().view(-1)
        )
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def dequantize(w: torch.Tensor, bits: int) -> torch.Tensor:
    """The weights the packed form stands for, in float32 (for tests and tolerances)."""
    if bits == 4:
        q, d, m = q4_1(w)
        n, k = w.shape
        return (q.view(n, -1, GROUP).float() * d[..., None] + m[..., None]).view(n, k)
    q, d = q8_0(w)
    return (q.view(w.shape[0], -1, GROUP).float() * d[..., None]).view(w.shape)


S8_SEGMENT = 64
"""The VNNI int8 linear's activation segment (``csrc/qlinear.h``'s ``kS8Seg``): one scale per row per
this many inputs."""


@dataclass
class Int8Weight:
    """A layer for forwards of more rows than the GEMV kernel takes (``--enable-int8-batch``: prefill
    chunks, and batched decodes on the VNNI route): weights int8 per output channel, activations int8
    per token, quantized at each call. Two routes:

    - ``vnni`` (a CPU with AVX512-VNNI and no AMX): ``kvledger_cpu::int8_linear``, kvledger's own
      kernel over ``w`` in the int8 layout of ``csrc/qlinear.h`` without groups; the activations take
      one scale per row and per segment of ``S8_SEGMENT`` inputs (each segment's integer sum scaled
      once), which keeps the channels beside a large one precise: on SmolLM2's projections about
      half the per-row scheme's error (bench/RESULTS.md);
    - otherwise oneDNN's int8 linear (``onednn.qlinear_pointwise``, u8 x s8, on AMX tiles where the
      CPU has them) with one scale per row: ``kvledger_cpu::quantize_rows``, oneDNN at activation
      scale 1 with float32 output (it takes one activation scale per call), then
      ``kvledger_cpu::scale_rows`` applies each row's own scale (and the bias).
    """

    w: torch.Tensor  # oneDNN's prepacked int8 weight, or the VNNI layout [N/16 * K/4 * 16 * 4] int8
    w_scale: torch.Tensor  # float32 [N]
    zero: torch.Tensor | None  # int64 zeros [N] (oneDNN)
    woff: torch.Tensor | None  # int32 [segments, N]: -128 * each segment's sum of row n's codes (VNNI)
    nbytes: int

    @property
    def vnni(self) -> bool:
        return self.woff is not None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        k = torch.ops.kvledger_cpu
        if self.vnni:
            return k.int8_linear(x, self.w, self.w_scale, self.woff, bias)
        xq, s = k.quantize_rows(x)
        y = torch.ops.onednn.qlinear_pointwise(
            xq, 1.0, 128, self.w, self.w_scale, self.zero, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return k.scale_rows(y, s, bias, x)


def int8_linear(w: torch.Tensor, route: str | None = None) -> Int8Weight | None:
    """Per-channel symmetric int8 of ``w [N, K]``; None where neither route is available. ``route``:
    ``"vnni"`` or ``"onednn"`` (tests take each), else kvledger's kernel on a CPU with VNNI and
    without AMX (oneDNN's int8 GEMM runs on the tiles there), oneDNN otherwise."""
    if w.device.type != "cpu":
        return None
    wf = w.float()
    scale = (wf.abs().amax(1) / 127).clamp(min=1e-12)
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    n, k = q.shape
    fits = _vnni() and n % ROWS == 0 and k % 4 == 0  # the kernel takes whole blocks of 16 outputs
    if route is None:
        route = "vnni" if fits and not has_amx() else "onednn"
    if route == "vnni":
        if not fits:
            return None
        packed = q.view(n // ROWS, ROWS, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(-1)
        woff = torch.stack([c.sum(1, dtype=torch.int32) for c in q.split(S8_SEGMENT, dim=1)]) * -128
        return Int8Weight(packed, scale, None, woff.contiguous(), q.numel() + n * 4 + woff.numel() * 4)
    if not hasattr(torch.ops.onednn, "qlinear_prepack"):
        return None
    try:
        packed = torch.ops.onednn.qlinear_prepack(q, None)
    except RuntimeError:
        return None
    return Int8Weight(packed, scale, torch.zeros(n, dtype=torch.int64), None, q.numel() + scale.numel() * 4)


def _vnni() -> bool:
    """Whether kvledger's kernels are built and the CPU has AVX512-VNNI."""
    return load() and quant_isa() == "avx512-vnni"
