"""The Llama family: Llama, SmolLM, Mistral, Qwen2, Qwen3 (pre-norm decoder, SwiGLU, rotary;
Qwen2's QKV biases, Qwen3's per-head q/k norms, Mistral's sliding window).

The fast path of kvledger's default model: eager forwards with the ``cpu`` attention backend run
the norms, rotary and SiLU in the C++ kernels (``fused``), and a batch of decodes runs every layer
in one kernel call (``decode_plan``/``decode_step``) where the layers are the kernel's packed
projections.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ...comm import Comm
from ..config import SLIDING, ModelConfig
from ..gguf_map import unpermute_attention
from ..layers import Attention, GatedMLP, LMHead, RMSNorm, Rotary, VocabEmbedding, rms_norm
from ..quantized import Weight
from .base import Builder, CausalNet, Projections

# model_type -> (qkv bias, per-head q/k RMSNorm)
VARIANTS: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


@dataclass(frozen=True)
class DecodePlan:
    args: tuple  # kvledger_cpu::decode_layers' weight arguments, in its order
    max_rows: int  # the most rows (decodes) a step may have for it
    amx_rows: int = 0  # calls of this many rows and more on AMX tiles (``PackedWeight.amx_rows``)
    int8: tuple = ([], [], [])  # the projections' int8 copies (VNNI route): weights, scales, sums
    int8_rows: int = 0  # steps of this many decodes and more run on ``int8`` (0: never)


class LlamaLayer(Projections, nn.Module):
    def __init__(self, attn: Attention, mlp: GatedMLP, in_norm: torch.Tensor, post_norm: torch.Tensor):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        # raw weights: the C++ kernels take them as they are
        self.in_norm = nn.Parameter(in_norm, requires_grad=False)
        self.post_norm = nn.Parameter(post_norm, requires_grad=False)


class LlamaNet(CausalNet):
    model_types = tuple(VARIANTS)

    def __init__(
        self,
        cfg: ModelConfig,
        embed: VocabEmbedding,
        layers: list[LlamaLayer],
        norm: RMSNorm,
        lm_head: LMHead,
        comm: Comm,
        rotary: Rotary,
        fused: bool,
    ):
        """``fused``: eager forwards use kvledger's C++ norm/rotary/SiLU kernels (loaded)."""
        super().__init__(cfg, embed, layers, norm, lm_head, comm)
        self.rotary = rotary
        self.fused = fused

    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        bias, qk_norm = VARIANTS[cfg.arch]
        cfg.attention_bias = bool(raw.get("attention_bias", bias))
        cfg.qk_norm = qk_norm
        window = raw.get("sliding_window") if raw.get("use_sliding_window", cfg.arch == "mistral") else None
        if window:
            cfg.sliding_window = int(window)
            # Qwen2/3 slide from layer max_window_layers on (transformers 5 writes layer_types)
            first = int(raw.get("max_window_layers", 0)) if cfg.arch != "mistral" else 0
            cfg.layer_types = raw.get("layer_types") or [
                SLIDING if i >= first else "full_attention" for i in range(cfg.num_layers)
            ]

    @classmethod
    def gguf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        # llama.cpp's Llama converter (Llama, Mistral) permutes the q/k rows; Qwen2/3's does not
        if cfg.arch in ("llama", "mistral"):
            weights = unpermute_attention(weights, cfg)
        return super().gguf_weights(weights, cfg)

    @classmethod
    def build(cls, b: Builder) -> LlamaNet:
        cfg = b.cfg
        embed, head = b.vocab_ends()
        norm = b.norm("model.norm.weight")
        rotary = b.rotary()
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = b.attention(i, rotary, norms=cfg.qk_norm)
            mlp = b.gated_mlp(p + "mlp")
            in_norm = b.cast(b.take(p + "input_layernorm.weight"))
            layers.append(
                LlamaLayer(attn, mlp, in_norm, b.cast(b.take(p + "post_attention_layernorm.weight")))
            )
        # The C++ rotary kernel turns whole heads: partial rotation (Phi-4-mini) runs the torch ops.
        return cls(cfg, embed, layers, norm, head, b.comm, rotary, b.fused and rotary.rot_dim == cfg.head_dim)

    @functools.cached_property
    def decode_plan(self) -> DecodePlan | None:
        """What ``kvledger_cpu::decode_layers`` takes, built once; None where the layers are not all
        the kernel's packed projections without biases or q/k norms, with SiLU, on one rank, with
        the kernels loaded (the Python loop then runs). Projections and weights are not replaced
        after construction (``Linear.unpack`` only touches the bf16 copy). A forward where a sliding
        window cuts some sequence does not take it (``CausalLM._forward``)."""
        projs = [p for L in self.layers for p in (L.attn.qkv, L.attn.o, L.mlp.gate_up, L.mlp.down)]
        if (
            not self.fused
            or self.comm.size > 1
            or any(p.qw is None or p.b is not None for p in projs)
            or any(L.attn.q_norm is not None or L.mlp.act_name != "silu" for L in self.layers)
        ):
            return None
        qw = [p.qw for p in projs]
        args = (
            [q.w for q in qw],
            [q.scales for q in qw],
            [q.wsum128 for q in qw],
            [q.bits for q in qw],
            [q.out_features for q in qw],
            [L.in_norm for L in self.layers],
            [L.post_norm for L in self.layers],
        )
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
        return DecodePlan(args, max_rows, tile_rows.pop(), int8, rows8.pop() if in_call else 0)

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
    ) -> torch.Tensor:
        """The forward of a batch of decodes with every layer in one kernel call; the same ops in the
        same order as ``forward``'s fused path, so the same logits bit for bit."""
        h = self.embed(input_ids)
        torch.ops.kvledger_cpu.decode_layers(
            h, *plan.args, kv_buffer.k, kv_buffer.v, positions, self.rotary.cos, self.rotary.sin, table, rows,
            lens, out_loc, self.cfg.num_heads, scale, self.cfg.rms_norm_eps, plan.amx_rows, *plan.int8,
            plan.int8_rows,
        )  # fmt: skip
        return self.lm_head(self.norm(h[logit_index]))

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The C++ kernels in eager forwards; a compiled graph keeps the torch ops (Inductor fuses them).
        fused = self.fused and not torch.compiler.is_compiling()
        kops = torch.ops.kvledger_cpu if fused else None
        cs = None if fused else self.rotary.lookup(positions)
        comm = self.comm
        eps = self.cfg.rms_norm_eps
        h = self.embed(input_ids)

        def add_norm(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor):
            """``h + delta`` and its RMS norm; the kernel adds into ``h`` in place."""
            if fused:
                return h, kops.add_rms_norm(h, delta, w, eps)
            h = h + delta
            return h, rms_norm(h, w, eps)

        x = (
            kops.rms_norm(h, self.layers[0].in_norm, eps)
            if fused
            else rms_norm(h, self.layers[0].in_norm, eps)
        )
        n_layers = len(self.layers)
        for i, L in enumerate(self.layers):
            h, x = add_norm(h, comm.all_reduce(L.attn(x, positions, cs, kops)), L.post_norm)
            # SiLU and the product in the GEMMs' epilogues where the layer has the split AMX copy.
            act = L.mlp.gate_up.silu_gated(x) if fused else None
            if act is None and fused and L.mlp.act_name == "silu":
                act = kops.silu_mul(L.mlp.gate_up(x))
            elif act is None:
                g, u = L.mlp.gate_up(x).chunk(2, dim=-1)
                act = L.mlp.act(g) * u
            delta = comm.all_reduce(L.mlp.down(act))
            if i + 1 < n_layers:
                h, x = add_norm(h, delta, self.layers[i + 1].in_norm)
            else:
                h = h + delta
        return h
