"""Linear-layer weights, optionally with a weight-only int8 or int4 copy.

Where kvledger's CPU kernels load, the copy is its own (``kernels/quant.py``: GGUF's Q4_1 / Q8_0
blocks, int8 activations per block of 32, VNNI dot products) and serves every call: one row is bound
by streaming the weights (int4 reads a quarter of bf16's bytes), and from 16 rows up the integer dot
products still beat the prepacked bf16 GEMM 1.2-1.5x on this CPU. A GGUF matrix of another kind the
kernels read (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, or a fused stack of kinds) is served as the
file stores it (``kernels/gguf_weight.GgufWeight``, ``gguf_linear``). Without the kernels, torch's
``_weight_int8pack_mm`` (int8, per-output-channel scales) and ``_weight_int4pack_mm_for_cpu`` (int4
in groups of 32, a bf16 scale and zero per group) serve calls of up to ``small_rows`` rows, where
they are 2-4x faster than bf16; the bf16 GEMM wins from ~8 rows up, so those modes keep both copies
and pick per call by row count.

int4 groups of 32 with ``w = (q - 8) * scale + zero`` are exactly GGUF's Q4_1 blocks (``w = d*q + m``
with the block's min and max mapping to codes 0 and 15), so quantizing weights that were dequantized
from Q4_1 recovers the file's own codes: no error beyond rounding ``d`` and ``m`` to bf16.
"""

from __future__ import annotations

import os
import warnings

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels.gguf_weight import GGUF_KERNEL_KINDS, GgufWeight
from ..kernels.quant import (
    GROUP,
    Int8Weight,
    PackedWeight,
    int8_linear,
    pack,
    pack_blocks,
    q4_1,
)
from .quantized import PACKED_BITS, BlockStack, BlockWeight, Weight, dense

QUANTIZATIONS = (None, "int8", "int4")
INT4_GROUP = GROUP  # GGUF Q4_1 blocks: the same groups on both int4 paths
PACK_ROWS_HINT = 32  # oneDNN picks the blocked layout for this many rows; 1..256 all run well with it
INT8_BATCH_ROWS = 128
"""With ``int8_batch``, calls of at least this many rows (prefill chunks) take the int8 linear
(``quant.Int8Weight``).
Below it kvledger's int4/int8 kernel is the faster one on this CPU (SmolLM2's four projections, both
threads: 0.78x oneDNN's time at 32 rows, 0.96x at 64, 1.04x at 128, 1.31x at 512), so batched decodes
stay on it and on the file's own weights. On kvledger's VNNI route ``INT8_VNNI_ROWS`` instead."""

INT8_VNNI_ROWS = 16
"""With ``int8_batch`` on kvledger's own int8 kernel (``Int8Weight.vnni``: a CPU with AVX512-VNNI and
no AMX), calls of at least this many rows take it, batched decodes included (``decode_plan`` passes
the int8 copies to the one-call decode): one scale a segment of 64 inputs instead of the int4 groups'
three per 32. SmolLM2's 120 projections, both threads, Zen 4 (int4 kernel vs int8): 6.2 vs 7.2 ms at
8 rows, 7.3 vs 7.6 at 12, 9.0 vs 8.7 at 16, 11.5 vs 10.7 at 24, 14.2 vs 12.7 at 32, 25.4 vs 21.8 at
64; the Q8_0 LM head 4.1 vs 3.7 at 32 rows. Further from the file than the int4 kernel (per-channel
int8 of the Q4_1 weights): ``bench/quant_agreement.py --batch`` in bench/RESULTS.md."""


AMX_MIN_ROWS = 192
"""With the AMX copy (``KernelSettings.cpu_amx``), calls of at least this many rows take oneDNN's bf16
GEMM on it instead of kvledger's kernel. Below it, from ``AMX_TILE_ROWS``, the kernel's own AMX-tile
path (the packed weights dequantized per call) is the faster: SmolLM2's 120 projections, both threads,
on an Intel Xeon with AMX: tiles 11.7 vs oneDNN 16.1 ms at 64 rows, 18.7 vs 22.2 at 128; from 192 about
equal or oneDNN ahead (25.4-25.9 vs 23.4-24.4 at 192, 33.3 vs 29.6 at 256, 60-62 vs 62 at 512, 137 vs
126 at 1,024; bench/RESULTS.md). Batched decodes below it keep the one-call C++ decode (``decode_plan``)."""

AMX_TILE_ROWS = 24
"""With AMX (``KernelSettings.cpu_amx`` and a CPU with AMX-BF16 tiles), kvledger's quantized-linear
kernel takes calls of at least this many rows (up to ``AMX_MIN_ROWS``, where the AMX copy's oneDNN
GEMM takes over) on AMX tiles: each call dequantizes the int4/int8 weights to bf16 (the AMX copy's
values), the next block pair's while the tiles multiply the current one, and multiplies 16 rows at a
time, instead of the VNNI path's per-row, per-group scaling. SmolLM2's 120 projections, both threads:
VNNI 4.2 vs tiles 8.1 ms at 8 rows, 7.3 vs 7.3 at 16, 10.4 vs 9.2 at 24, 13.1 vs 8.1 at 32, 22.2 vs
11.7 at 64. The dequantization costs the same whatever the row count, hence not below 24."""


def amx_available() -> bool:
    """This CPU has AMX tiles (oneDNN's bf16 GEMMs and torch's SDPA use them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def use_amx(setting: str, device: torch.device, dtype: torch.dtype, quantization: str | None) -> bool:
    """Whether a model keeps the AMX paths (``KernelSettings.cpu_amx``): ``on`` for a quantized
    bfloat16 model on the CPU whose oneDNN has bf16 kernels (any such CPU: AMX or not, the same
    calls run); ``auto`` where the CPU also has AMX; ``off`` never."""
    if setting == "off" or quantization is None or dtype != torch.bfloat16 or device.type != "cpu":
        return False
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    return setting == "on" or amx_available()


def can_prepack(w: torch.Tensor) -> bool:
    """oneDNN prepacking applies to bf16 weights on a CPU whose oneDNN has bf16 kernels."""
    return (
        w.dtype == torch.bfloat16
        and w.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns ``(q [N, K] int8, scale [N] float32)``."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of 32 along K (GGUF's Q4_1 blocks): returns ``(q [N, K] int32 in
    0..15, scale [N, K/32], zero [N, K/32])`` with ``w ~= (q - 8) * scale + zero``."""
    q, d, m = q4_1(w, scale_dtype=None)  # torch's kernel keeps its scales in the activations' dtype
    return q, d, m + 8 * d


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``; with kvledger's quantized copy every call uses it, with torch's calls of
    at most ``small_rows`` rows; with ``int8_batch`` calls of at least ``INT8_BATCH_ROWS`` rows use
    the int8 linear (``quant.Int8Weight``) instead (per-token int8 activations).

    ``w`` is the weight as loaded: a float tensor, or a GGUF file's blocks (``BlockWeight``), which
    the kernel packs as they are when their format is the mode's (Q4_1 for int4, Q8_0 for int8);
    blocks of the other kinds ``gguf_linear`` reads (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL) are
    served as stored in either mode (``GgufWeight``: the file's bytes, no copy, no re-quantization).
    A dense copy in ``dtype`` on ``device`` (default: ``w``'s own; float32 for blocks) is kept only
    where a call can read it: not when kvledger's kernel serves every call (``unpack`` makes one
    for ``torch.compile``). With ``amx`` (``use_amx``), a layer the kernel serves also keeps a
    prepacked bf16 copy of the kernel's own weights for calls of ``amx_rows`` rows and more.
    """

    def __init__(
        self,
        w: Weight,
        b: torch.Tensor | None = None,
        quantization: str | None = None,
        small_rows: int = 4,
        prepack: bool = True,
        int8_batch: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        amx: bool = False,
        deterministic: bool = False,
    ):
        super().__init__()
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        blocks = isinstance(w, (BlockWeight, BlockStack))
        self.dtype = dtype or (torch.float32 if blocks else w.dtype)
        self.device = torch.device(device or ("cpu" if blocks else w.device))
        self.out_features, self.in_features = w.shape
        if quantization is not None and self.dtype != torch.bfloat16:
            raise ValueError(f"{quantization} weights need bfloat16 activations (dtype bfloat16)")
        if quantization == "int4" and self.device.type != "cpu":
            raise ValueError("int4 weights use torch's CPU kernel; on other devices use int8")
        self.b = None if b is None else nn.Parameter(b, requires_grad=False)
        self.register_buffer("q", None, persistent=False)
        self.register_buffer("q_scale", None, persistent=False)
        self.small_rows = small_rows
        self.mode = quantization
        # --enable-deterministic-inference: every call on a kernel whose sums have one order per row (the
        # quantized copy's, or the dense kernel on the weight as loaded: ``path``); no oneDNN, AMX or int8.
        self.deterministic = deterministic
        if deterministic:
            prepack, int8_batch, amx = False, False, False
        # kvledger's VNNI kernel where it loads and the shape has whole blocks; torch's kernels otherwise
        self.qw: PackedWeight | GgufWeight | None = None
        self.w8: Int8Weight | None = None  # int8_batch_rows rows and more: the int8 linear
        if quantization is not None and self.device.type == "cpu" and kernels.load():
            self.qw = _pack(w, 4 if quantization == "int4" else 8)
            if deterministic and isinstance(self.qw, GgufWeight):
                self.qw.tile_rows = 0  # the rows' path at any batch: one order of sums a row
            self.w8 = int8_linear(dense(w)) if self.qw is not None and int8_batch else None
        # read here, so a test may lower them for the layers it builds
        self.int8_batch_rows = INT8_VNNI_ROWS if self.w8 is not None and self.w8.vnni else INT8_BATCH_ROWS
        if quantization == "int4" and self.in_features % INT4_GROUP:
            self.mode = "int8"  # int4 needs whole groups along K; int8 has no such constraint
        # The dense weight: every call of a layer without the kernel's copy may need it.
        self.w = None
        if self.qw is None:
            self.w = nn.Parameter(self._cast(dense(w)), requires_grad=False)
        if self.qw is not None:
            self.mode = quantization
        elif self.mode in ("int8", "int4"):
            self._torch_quantized(dense(w))
        # An opaque oneDNN tensor; a plain attribute (not a parameter: module utilities that walk
        # parameters, such as weight_bytes or state_dict, cannot read its storage).
        self.packed: torch.Tensor | None = None
        # LoRA adapters' deltas on this projection (``lora.LoraLayer``; None: no adapter can apply).
        self.lora = None
        if prepack and self.w is not None and can_prepack(self.w):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w, PACK_ROWS_HINT)
            self.w = None
        self.amx_rows = AMX_MIN_ROWS  # read here, so a test may lower it for the layers it builds
        # A gated MLP's gate_up with the AMX copy: its gate and up halves apart (``split_gated``).
        self.gated: tuple[torch.Tensor, torch.Tensor] | None = None
        if amx and self.qw is not None:
            if kernels.has_amx() and isinstance(self.qw, PackedWeight):
                self.qw.amx_rows = AMX_TILE_ROWS
            # The values the kernel computes with (the file's Q4_1/Q8_0 blocks, dequantized exactly),
            # so both paths share the weights and differ only in the kernel's int8 activations.
            wb = self._cast(self.qw.rows())
            if can_prepack(wb):
                self.packed = torch.ops.mkldnn._reorder_linear_weight(wb, PACK_ROWS_HINT)

    def _torch_quantized(self, w: torch.Tensor) -> None:
        """``q`` and ``q_scale`` for torch's int8/int4 weight-only kernels (a layer the kvledger kernel
        does not serve: no kernels, or a shape without whole blocks)."""
        if self.mode == "int8":
            q, scale = quantize_int8(w)
            self.q = q.to(self.device)
            self.q_scale = scale.to(device=self.device, dtype=self.dtype)
            return
        q, scale, zero = quantize_int4(w)
        self.q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(self.device), 1)
        # [K/group, N, 2]: the layout the int4 kernel reads
        self.q_scale = (
            torch.stack([scale.t(), zero.t()], dim=-1).to(device=self.device, dtype=self.dtype).contiguous()
        )

    def split_gated(self) -> None:
        """For a SwiGLU MLP's ``gate_up`` (gate rows, then up rows) with the AMX copy: that copy as two
        oneDNN weights, gate and up, so that ``silu_gated`` runs SiLU and the product in the GEMMs'
        epilogues (oneDNN post-ops) instead of writing both halves out and reading them back (at
        2,048 rows 6 MB a layer, past the L2 cache). Calls of fewer rows use the kernel, as before."""
        if self.packed is None or self.qw is None or self.b is not None or self.out_features % 2:
            return
        w = self.packed.to_dense()
        half = self.out_features // 2
        self.gated = tuple(torch.ops.mkldnn._reorder_linear_weight(p.contiguous(), PACK_ROWS_HINT)
                           for p in (w[:half], w[half:]))  # fmt: skip
        self.packed = None  # the halves replace it (path: calls here of amx_rows and more take tiles)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate(x)) * up(x)`` from the split AMX copy, or None where this call does not take it
        (no split copy, an adapter on the layer, or fewer rows than ``amx_rows``)."""
        if self.gated is None or self.lora is not None or x.shape[0] < self.amx_rows:
            return None
        if torch.compiler.is_compiling():
            return None
        gate, up = self.gated
        g = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, g, up, None, "mul")

    def _cast(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(device=self.device, dtype=self.dtype).contiguous()

    def unpack(self) -> None:
        """Bring back the dense weight (for ``torch.compile``, whose freezing pass packs it again); a
        layer the kernel serves alone gets its weights dequantized from the kernel's copy."""
        if self.packed is not None:
            self.w = nn.Parameter(self.packed.to_dense(), requires_grad=False)
            self.packed = None
        elif self.w is None and self.qw is not None:
            self.w = nn.Parameter(self._cast(self.qw.rows()), requires_grad=False)
        self.gated = None  # the compiled graph runs the dense weight (Inductor fuses the epilogue)

    def packed_bytes(self) -> int:
        """Bytes held outside parameters and buffers: the oneDNN weight and the kernel's quantized one."""
        dense = [self.packed] if self.packed is not None else list(self.gated or ())
        n = sum(p.numel() * p.element_size() for p in dense)
        return n + (0 if self.qw is None else self.qw.nbytes()) + (0 if self.w8 is None else self.w8.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        # The adapters of this forward's rows (``model/lora.py``), added on top of the base output.
        return y if self.lora is None else self.lora(x, y)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile the quantized branches would add a size guard per layer (and a second
        # graph); compiled graphs run the bf16 GEMM, which Inductor packs. (is_compiling first:
        # comparing the symbolic row count would itself add the guard.)
        if (self.q is not None or self.qw is not None or self.deterministic) and not torch.compiler.is_compiling():
            y = self._quantized(x)
            if y is not None:
                return y
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")
        return F.linear(x, self.w, self.b)

    def path(self, rows: int) -> str:
        """Which product a call of ``rows`` rows runs (eager): ``int8`` (the int8 linear, from
        ``int8_batch_rows`` with ``int8_batch``), ``amx`` (the AMX copy's bf16 GEMM, from ``amx_rows``),
        ``tiles`` (kvledger's kernel on AMX tiles, from ``qw.amx_rows``: ``AMX_TILE_ROWS``),
        ``kernel`` (kvledger's; without AMX it beats the prepacked bf16 GEMM at every row count:
        bench/RESULTS.md), ``torch`` (torch's weight-only kernels, up to ``small_rows``), ``dense``
        (the bf16 or float weight: oneDNN's prepacked GEMM or ``F.linear``) or, under deterministic
        inference, ``rows`` (kvledger's dense kernel: each output one order of sums whatever the rows)."""
        if self.deterministic:
            return "kernel" if self.qw is not None else "rows"
        if self.w8 is not None and rows >= self.int8_batch_rows:
            return "int8"
        if self.qw is not None:
            if self.packed is not None and rows >= self.amx_rows:
                return "amx"
            return "tiles" if self.qw.amx_rows and rows >= self.qw.amx_rows else "kernel"
        return "torch" if self.q is not None and rows <= self.small_rows else "dense"

    def _quantized(self, x: torch.Tensor) -> torch.Tensor | None:
        """The quantized path's output for this call, or None where a bf16 GEMM is the one to run."""
        path = self.path(x.shape[0])
        if path == "int8":
            return self.w8(x, self.b)
        if path == "rows":
            return torch.ops.kvledger_cpu.dense_linear(x.contiguous(), self.w, self.b)
        if path in ("kernel", "tiles"):
            y = self.qw(x)
        elif path != "torch":
            return None
        elif self.mode == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q, INT4_GROUP, self.q_scale)
        else:
            y = torch._weight_int8pack_mm(x, self.q, self.q_scale)
        return y if self.b is None else y + self.b


def place_packed_weights(net: nn.Module) -> int:
    """Move the kernels' packed weights of ``net`` (every ``PackedWeight``'s codes, scales and sums,
    and the VNNI int8 copies') into one allocation advised for transparent huge pages; returns the
    bytes moved. A decode step reads every weight once, from memory: in 4 KB pages each page is a TLB
    miss of its own, and 30 layers' int4 projections at 32 rows took 14.6-15.0 ms against 12.0-13.5
    with one layer's weights reused; in huge pages 13.7-13.9 (bench/RESULTS.md). The tensors become
    views of the allocation, same values, same layout."""
    from ..memory.pools import zeroed_host_tensor

    seen: set[int] = set()
    slots: list[tuple[object, str]] = []  # (holder, attribute) of each tensor to move
    for m in net.modules():
        for v in list(vars(m).values()):
            if id(v) in seen:
                continue
            if isinstance(v, PackedWeight):
                names = ("w", "scales", "wsum128")
            elif isinstance(v, Int8Weight) and v.vnni:
                names = ("w", "w_scale", "woff")
            else:
                continue
            seen.add(id(v))
            slots += [(v, n) for n in names if isinstance(getattr(v, n), torch.Tensor)]
    tensors = [getattr(h, n) for h, n in slots]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return 0
    align = 64

    def size(t: torch.Tensor) -> int:
        return -(-t.numel() * t.element_size() // align) * align

    arena = zeroed_host_tensor((sum(size(t) for t in tensors),), torch.uint8)
    off = 0
    for (holder, name), t in zip(slots, tensors):
        n = t.numel() * t.element_size()
        view = arena[off : off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        setattr(holder, name, view)
        off += size(t)
    return off


# The load-time repack of Q4_K/Q6_K/Q8_0/Q5_0 layers (a switch for benchmarks and tests of the as-stored path).
REPACK = os.environ.get("KVLEDGER_GGUF_REPACK", "1") != "0"


def _pack(w: Weight, bits: int) -> PackedWeight | GgufWeight | None:
    """The kernel's copy of ``w``: a file's blocks of a kind the load-time repack interleaves (Q4_K,
    Q6_K, Q8_0, Q5_0 on a VNNI CPU) repacked; of another kind ``gguf_linear`` reads other than
    Q4_1/Q8_0, and any stack of kinds, as they are (a view where they are contiguous, as the loader's
    are); Q4_1/Q8_0 blocks of the mode's width packed as they are (their own codes and scales);
    anything else quantized first."""
    if isinstance(w, BlockStack) and all(p.kind in GGUF_KERNEL_KINDS for p in w.parts):
        parts = tuple((p.kind, p.shape[0]) for p in w.parts)
        if _repacks(parts, w.shape[1]):  # the file's pages dropped after the build (release_file_pages)
            # Each part read from its view of the file into the one repacked buffer (no concatenated
            # copy first); a run of one kind then served as one part, as a fused tensor of that kind is
            # (the same bytes: every part before the run's last holds whole groups of 16 rows).
            return _repacked(w.parts)
        flat = np.concatenate([p.raw.reshape(-1) for p in w.parts])  # one copy, as a fused tensor's
        return GgufWeight(parts, w.shape[1], torch.from_numpy(flat))
    if isinstance(w, BlockWeight) and w.kind in GGUF_KERNEL_KINDS:
        if _repacks(((w.kind, w.shape[0]),), w.shape[1]):  # Q8_0 too: the file's size, where int8 is 1.18x
            return _repacked((w,))
        if w.kind not in PACKED_BITS:
            return GgufWeight(((w.kind, w.shape[0]),), w.shape[1], _view(w.raw))
    if isinstance(w, BlockWeight) and w.bits == bits:
        return pack_blocks(*w.codes(), bits=bits)
    return pack(dense(w), bits)


def _repacked(blocks: tuple[BlockWeight, ...]) -> GgufWeight:
    """``blocks`` (a layer's parts, each a view of the file) repacked into one new buffer, each read
    in place: in its stored order, a q/k part's llama.cpp row order undone as it is read (the segments'
    heads column), so no part is copied before the repack."""
    in_features = blocks[0].shape[1]
    segs = torch.tensor(
        [[int(gguf.GGMLQuantizationType[b.kind]), b.shape[0], b.heads] for b in blocks], dtype=torch.int64
    )
    out = torch.ops.kvledger_cpu.gguf_repack([_view(b.stored) for b in blocks], segs, in_features, False)
    parts = tuple((b.kind, b.shape[0]) for b in blocks)
    return GgufWeight(_merge_runs(parts), in_features, out, packed=True)


def _merge_runs(parts: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """Adjacent parts of one kind as one part where the repacked bytes are the same (the earlier part
    holds whole groups of 16 rows, so no padding group lies between them)."""
    out: list[tuple[str, int]] = []
    for kind, rows in parts:
        if out and out[-1][0] == kind and out[-1][1] % 16 == 0:
            out[-1] = (kind, out[-1][1] + rows)
        else:
            out.append((kind, rows))
    return tuple(out)


def repacked_at_load(parts: list[Weight]) -> bool:
    """Whether a fused projection of ``parts`` (a GGUF file's blocks) is repacked when built
    (``_pack``): every part blocks of the kernel's kinds, and the repack applying to them."""
    if not all(isinstance(p, BlockWeight) and p.kind in GGUF_KERNEL_KINDS for p in parts):
        return False
    if len({p.shape[1] for p in parts}) != 1 or not kernels.load():
        return False
    return _repacks(tuple((p.kind, p.shape[0]) for p in parts), parts[0].shape[1])


def _view(raw: np.ndarray) -> torch.Tensor:
    """The blocks as a flat uint8 tensor: a view of the file's memory map where they are contiguous."""
    with warnings.catch_warnings():  # the memory map is read-only; the kernel only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))


def _repacks(parts: tuple[tuple[str, int], ...], in_features: int) -> bool:
    """Whether a layer's blocks are repacked at load (``GgufWeight.repack``): kinds the repack
    interleaves, and a CPU with the VNNI kernel that reads them (the portable kernel would unpack each
    group back on every call)."""
    probe = GgufWeight(parts, in_features, torch.empty(0, dtype=torch.uint8))
    return probe.repackable() and kernels.quant_isa() == "avx512-vnni" and REPACK
