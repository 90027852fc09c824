"""The one-call decode: a batch of decodes runs every layer in one C++ call
(``kvledger_cpu::decode_layers``, csrc/decode_step.cpp), each layer interpreted from its description.

A family opts in by describing its layers (``OneCallDecode.layer_desc``: a ``LayerDesc`` and the
layer's norm weights), not by a kernel of its own. The description holds what differs between the
families on this path: the norm kind (Llama's ``w * x_normed`` in the model dtype, or Gemma's
``x_normed * (1 + w)`` in float32) and places (before the attention and the MLP; after them, Gemma's
"sandwich" with both and OLMo 2's with only these), q/k norms (per head: Qwen3, Gemma 3; over the
whole projection: OLMo 2), the gated MLP's
activation (SiLU or GELU-tanh), the layer's rotary table (Gemma 3's local and global layers) and its
sliding window. The scale of the scores is the family's (``attention_scale``), the embedding's scale
is the embedding's (it runs before the call), the final norm and the head after it.

What the call does not do, the Python loop keeps: attention soft-capping (Gemma 2) and sinks
(gpt-oss), biased projections, routed experts, partial rotary, tensor parallel, LoRA
(``CausalLM._forward`` checks the batch)."""

from __future__ import annotations

import functools
from dataclasses import astuple, dataclass

import torch

from ..layers import Rotary
from ..layers.norm import RMSNorm

NORM_RMS, NORM_GEMMA = 0, 1  # csrc/decode_step.h's NormKind
QK_NONE, QK_HEAD, QK_FULL = 0, 1, 2  # its QkNorm
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}  # its ActKind


@dataclass(frozen=True)
class LayerDesc:
    """One layer as the C++ step reads it (csrc/decode_step.h's ``LayerDesc``, fields in its order)."""

    # every norm of the layer: NORM_RMS (weights of the model dtype) or NORM_GEMMA (1 + w, float32)
    norm: int = NORM_RMS
    post_norms: bool = False  # norms after the attention and after the MLP (Gemma 2/3, OLMo 2)
    qk_norm: int = QK_NONE  # q/k RMS norms before the rotary: QK_HEAD per head, QK_FULL whole (OLMo 2)
    act: int = 0  # ACTIVATIONS' value of the gated MLP's activation
    rope: int = 0  # index of the layer's rotary table in ``OneCallDecode.rope_tables()``
    window: int = 0  # sliding window in keys (0: every key)
    pre_norms: bool = True  # norms before the attention and the MLP (all but OLMo 2)

    def fields(self) -> list[int]:
        return [int(v) for v in astuple(self)]


@dataclass(frozen=True)
class LayerNorms:
    """A layer's norm weights as the step takes them (None where the layer has none): in the model
    dtype for NORM_RMS, ``1 + w`` in float32 for NORM_GEMMA."""

    pre_attn: torch.Tensor | None
    pre_ffn: torch.Tensor | None
    post_attn: torch.Tensor | None = None
    post_ffn: torch.Tensor | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None

    def slots(self) -> list[torch.Tensor | None]:
        """csrc/decode_step.h's NormSlot order."""
        return [self.pre_attn, self.post_attn, self.pre_ffn, self.post_ffn, self.q, self.k]


def norm_weight(norm: RMSNorm) -> tuple[int, torch.Tensor]:
    """A norm module's kind and the weight the step takes (``RMSNorm`` keeps Gemma's as ``1 + w``)."""
    return (NORM_GEMMA if norm.gemma else NORM_RMS), norm.weight


@dataclass(frozen=True)
class DecodePlan:
    args: tuple  # kvledger_cpu::decode_layers' weight and description arguments, in its order
    tables: tuple  # (cos tables, sin tables), one of each per rotary kind
    max_rows: int  # the most rows (decodes) a step may have for it
    amx_rows: int = 0  # calls of this many rows and more on AMX tiles (``PackedWeight.amx_rows``)
    int8: tuple = ([], [], [])  # the projections' int8 copies (VNNI route): weights, scales, sums
    int8_rows: int = 0  # steps of this many decodes and more run on ``int8`` (0: never)
    windows: bool = False  # some layer slides: the call applies its window (batches the window cuts too)


class OneCallDecode:
    """Mixin of a ``CausalNet`` whose decodes may run in one call: the family gives ``layer_desc``
    and ``rope_tables``; ``decode_plan`` and ``decode_step`` are shared."""

    fused: bool  # the C++ kernels are loaded and the cpu backend runs (the family's build sets it)

    def rope_tables(self) -> list[Rotary]:
        """The rotary kinds ``LayerDesc.rope`` indexes."""
        return [self.rotary]

    def layer_desc(self, i: int, layer) -> tuple[LayerDesc, LayerNorms] | None:
        """Layer ``i``'s description and norm weights, or None where the step cannot run it."""
        raise NotImplementedError

    @functools.cached_property
    def decode_plan(self) -> DecodePlan | None:
        """What ``kvledger_cpu::decode_layers`` takes, built once; None where some layer has no
        description, a projection is not the kernel's packed one (or, under deterministic inference,
        a dense weight on the dense kernel, or GGUF blocks: their batches take another order of sums) or has a bias, the attention soft-caps or has sinks, on
        more than one rank, or without the kernels (the Python loop then runs). Projections and
        weights are not replaced after construction (``Linear.unpack`` only touches the bf16 copy)."""
        if not self.fused or self.comm.size > 1 or self.attention_sinks() is not None:
            return None
        if type(self).attention_softcap(self.cfg) is not None:
            return None
        if any(r.rot_dim != self.cfg.head_dim for r in self.rope_tables()):
            return None  # the rotary kernel turns whole heads
        descs = [self.layer_desc(i, L) for i, L in enumerate(self.layers)]
        if any(d is None for d in descs):
            return None
        projs = [p for L in self.layers for p in (L.attn.qkv, L.attn.o, L.mlp.gate_up, L.mlp.down)]
        if any(p.b is not None for p in projs):
            return None
        dense = []
        if not all(p.qw is not None for p in projs):
            # deterministic inference's dense layers: the dense kernel, as their eager calls
            if not all(p.qw is None and p.deterministic and p.w is not None for p in projs):
                return None
            dense = [p.w for p in projs]
        qw = [p.qw for p in projs] if not dense else []
        if any(getattr(q, "tile_rows", -1) == 0 for q in qw):
            return None  # deterministic GGUF blocks: the eager calls keep one order of sums a row
        norms = [t for _, n in descs for t in n.slots()]
        desc = [v for d, _ in descs for v in d.fields()]
        args = (
            [q.w for q in qw],
            [q.scales for q in qw],
            [q.wsum128 for q in qw],
            [q.bits for q in qw],
            [q.out_features for q in qw],
            dense,
            norms,
            desc,
        )
        tables = ([r.cos for r in self.rope_tables()], [r.sin for r in self.rope_tables()])
        windows = any(d.window for d, _ in descs)
        if dense:
            return DecodePlan(args, tables, 1 << 62, windows=windows)
        # Every projection's int8 copy on kvledger's VNNI route, from one threshold: the kernel call
        # takes them from there. Otherwise calls from int8_batch_rows rows of a layer with an int8
        # copy (oneDNN's) go there, and from amx_rows rows of one with the AMX copy to oneDNN's bf16
        # GEMM (Linear._quantized), not the kernel.
        w8 = [p.w8 for p in projs]
        rows8 = {p.int8_batch_rows for p in projs}
        in_call = all(q is not None and q.vnni for q in w8) and len(rows8) == 1
        int8 = ([q.w for q in w8], [q.w_scale for q in w8], [q.woff for q in w8]) if in_call else ([], [], [])
        max_rows = min(
            [p.int8_batch_rows - 1 for p in projs if p.w8 is not None and not in_call]
            + [p.amx_rows - 1 for p in projs if p.packed is not None],
            default=1 << 62,
        )
        # One threshold for the AMX tiles (the kernel call takes one); layers built alike share it.
        tile_rows = {q.amx_rows for q in qw}
        if len(tile_rows) > 1:
            return None
        return DecodePlan(
            args, tables, max_rows, tile_rows.pop(), int8, rows8.pop() if in_call else 0, windows
        )

    def decode_step(
        self,
        plan: DecodePlan,
        input_ids,
        positions,
        logit_index,
        kv_buffer,
        table,
        rows,
        lens,
        out_loc,
        scale,
        greedy: bool = False,
        sparse: tuple = (),
    ) -> torch.Tensor:
        """The forward of a batch of decodes with every layer in one kernel call (the embedding, its
        scale included, before it; the final norm and the head after). ``greedy``: the rows' greedy
        tokens from the head in C++ (``LMHead.greedy``), not their logits. ``sparse``: HiSparse rows'
        arguments (``CpuAttention``'s ``one_call_sparse``: host pool, summaries, rows, host pages,
        lengths, parameters); their attention reads the host pool in place."""
        h = self.embed(input_ids).contiguous()
        torch.ops.kvledger_cpu.decode_layers(
            h, *plan.args, kv_buffer.k, kv_buffer.v, positions, *plan.tables, table, rows, lens, out_loc,
            self.cfg.num_heads, scale, self.cfg.rms_norm_eps, plan.amx_rows, *plan.int8, plan.int8_rows, *sparse,
        )  # fmt: skip
        x = self.norm(h[logit_index])
        return self.lm_head.greedy(x) if greedy else self.lm_head(x)
