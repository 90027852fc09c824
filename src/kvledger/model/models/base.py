"""What every family shares: the builder that turns loaded weights into layers (``Builder``), and
the network's shell (``CausalNet``: embedding, layers, final norm, LM head, pooling).

A family is one file with a ``CausalNet`` subclass that says how its config and weights read from a
HF checkpoint (``hf_config``, ``hf_weights``) and from llama.cpp's GGUF (``gguf_tensors``,
``gguf_config``, ``gguf_weights``), how its attention behaves per layer (``attention_scale``,
``attention_softcap``; sinks are weights: ``attention_sinks``), how it is built (``build``) and how its hidden states flow (``hidden``);
the registry (``registry.py``) maps HF ``model_type`` names (and GGUF architectures) to it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from ...comm import Comm
from ...errors import ModelLoadError
from ...kernels.quant import GGUF_KERNEL_KINDS, GgufWeight
from ..config import ModelConfig
from ..gguf_map import DECODER, GGUFMeta
from ..layers import Attention, GatedMLP, LMHead, RMSNorm, Rotary, VocabEmbedding
from ..linear import Linear
from ..quantized import PACKED_BITS, BlockWeight, Weight, cat_rows, dense


@dataclass
class Builder:
    """Loaded weights (HF names, this rank's shards) and how to make layers of them."""

    cfg: ModelConfig
    weights: dict[str, Weight]
    dtype: torch.dtype
    device: torch.device
    quantization: str | None
    int8_batch: bool
    comm: Comm
    handle: int
    fused: bool  # attention backend ``cpu``: a family may run its norms/rotary/SiLU in the C++ kernels
    amx: bool = False  # quantized linears keep the AMX copy for large calls (``linear.use_amx``)
    deterministic: bool = False  # --enable-deterministic-inference: linears on row-invariant kernels only

    def take(self, name: str) -> Weight:
        try:
            return self.weights.pop(name)
        except KeyError:
            raise ModelLoadError(f"checkpoint lacks tensor {name}") from None

    def has(self, name: str) -> bool:
        return name in self.weights

    def cast(self, t: Weight) -> torch.Tensor:
        return dense(t).to(device=self.device, dtype=self.dtype).contiguous()

    def lin(self, w: Weight, b: Weight | None = None, mode: str | None = "default") -> Linear:
        """A ``Linear`` in the model's weight-only mode (``mode`` overrides it; None: dense)."""
        mode = self.quantization if mode == "default" else mode
        bias = None if b is None else self.cast(b)
        return Linear(
            w, bias, mode, int8_batch=self.int8_batch, dtype=self.dtype, device=self.device, amx=self.amx,
            deterministic=self.deterministic,
        )  # fmt: skip

    def proj(self, names: list[str], bias: bool = False) -> Linear:
        """The rows of ``names`` (``...q_proj`` ...) fused into one ``Linear``."""
        w = cat_rows([self.take(n + ".weight") for n in names])
        b = torch.cat([dense(self.take(n + ".bias")) for n in names]) if bias else None
        return self.lin(w, b)

    def norm(self, name: str, gemma: bool = False) -> RMSNorm:
        return RMSNorm(
            dense(self.take(name)).to(self.device), self.cfg.rms_norm_eps, gemma=gemma, dtype=self.dtype
        )

    def attention(self, i: int, rotary: Rotary, norms: bool = False, gemma: bool = False, **kw) -> Attention:
        """Layer ``i``'s attention from HF's names (``model.layers.i.self_attn.{q,k,v,o}_proj``, and its
        ``q_norm``/``k_norm`` with ``norms``, Gemma's form with ``gemma``); ``kw`` go to ``Attention``
        (OLMo 2's ``qk_norm="full"``)."""
        cfg, a = self.cfg, f"model.layers.{i}.self_attn."
        return Attention(
            i,
            self.proj([a + "q_proj", a + "k_proj", a + "v_proj"], bias=cfg.attention_bias),
            self.lin(self.take(a + "o_proj.weight")),
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            rotary,
            self.handle,
            self.norm(a + "q_norm.weight", gemma=gemma) if norms else None,
            self.norm(a + "k_norm.weight", gemma=gemma) if norms else None,
            **kw,
        )

    def gated_mlp(self, prefix: str) -> GatedMLP:
        """The gated MLP at ``prefix`` (``model.layers.i.mlp``: ``gate_proj``, ``up_proj``, ``down_proj``)."""
        return GatedMLP(
            self.proj([prefix + ".gate_proj", prefix + ".up_proj"]),
            self.lin(self.take(prefix + ".down_proj.weight")),
            self.cfg.hidden_act,
        )

    def rotary(self, theta: float | None = None, scaling: dict | str | None = "cfg") -> Rotary:
        cfg = self.cfg
        return Rotary(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta if theta is None else theta,
            cfg.rope_scaling if scaling == "cfg" else scaling,
            cfg.partial_rotary_factor,
            self.dtype,
            self.device,
        )

    def vocab_ends(
        self, embed_scale: float | None = None, softcap: float | None = None
    ) -> tuple[VocabEmbedding, LMHead]:
        """The embedding and the LM head, tied or not. The LM head is int8 even in int4 mode (quantized
        checkpoints keep it at 8 bits: Q8_0 in SmolLM2's GGUF; its logits are what sampling sees). A
        tied Q8_0 embedding is looked up in the LM head's copy of the file's blocks."""
        cfg = self.cfg
        raw_embed = self.take("model.embed_tokens.weight")
        lm_head = self.weights.pop("lm_head.weight", None)
        tied = lm_head is None or cfg.tie_word_embeddings
        lm_mode = "int8" if self.quantization == "int4" else self.quantization
        lm = self.lin(raw_embed if tied else lm_head, mode=lm_mode)
        shared = (  # the head's copy holds the file's values: Q8_0 packed as is, or any kind served as stored
            tied
            and isinstance(raw_embed, BlockWeight)
            and lm.qw is not None
            and (raw_embed.kind == "Q8_0" or isinstance(lm.qw, GgufWeight))
        )
        table = lm.qw if shared else self._embed_table(raw_embed)
        return (
            VocabEmbedding(table, self.dtype, self.comm, embed_scale),
            LMHead(lm, cfg.vocab_size, self.comm, softcap),
        )


    def _embed_table(self, raw: Weight) -> torch.Tensor | GgufWeight:
        """An untied embedding's table: in a quantized mode on the CPU, a kind ``gguf_linear`` reads
        other than Q4_1/Q8_0 stays the file's blocks (``GgufWeight``, its rows dequantized as looked
        up: a Q4_K_M file's Q4_K table of 49k x 2048 is 54 MiB as stored, 192 MiB in bfloat16);
        otherwise the table in the model dtype."""
        if (
            self.quantization is not None
            and torch.device(self.device).type == "cpu"
            and isinstance(raw, BlockWeight)
            and raw.kind in GGUF_KERNEL_KINDS
            and raw.kind not in PACKED_BITS
        ):
            with warnings.catch_warnings():  # a view of the read-only memory map; only ever read
                warnings.simplefilter("ignore", UserWarning)
                blocks = torch.from_numpy(np.ascontiguousarray(raw.raw))
            return GgufWeight(((raw.kind, raw.shape[0]),), raw.shape[1], blocks)
        return self.cast(raw)


class CausalNet(nn.Module):
    """The whole forward as one module, so ``torch.compile`` can freeze its weights (and prepack them
    for oneDNN) and fuse the elementwise work; attention is the opaque op ``kvledger::attention``."""

    model_types: ClassVar[tuple[str, ...]] = ()
    supports_tp: ClassVar[bool] = True
    # A decode forward of fixed shapes, whatever the tokens (a CUDA graph can hold it:
    # ``engine/graph_runner.py``); routed experts size their matmuls by the routing.
    graph_safe: ClassVar[bool] = True

    def __init__(
        self,
        cfg: ModelConfig,
        embed: VocabEmbedding,
        layers: list[nn.Module],
        norm: RMSNorm,
        lm_head: LMHead,
        comm: Comm,
    ):
        super().__init__()
        self.cfg = cfg
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.comm = comm  # tensor parallel: the O/down all-reduces (the vocabulary ends hold the same one)

    # -- what a family says about itself (class methods: read before any weight is) ----------------
    @classmethod
    def hf_config(cls, raw: dict, cfg: ModelConfig) -> None:
        """Fill the family's settings of ``cfg`` from a config.json dict (in place)."""

    @classmethod
    def hf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        """The checkpoint's tensors under the names ``build`` takes (renames, fused ones split)."""
        return weights

    gguf_tensors: ClassVar[dict] = DECODER
    """llama.cpp's tensors (``gguf.MODEL_TENSOR``) -> the HF names ``gguf_weights`` takes (``gguf_map``)."""

    @classmethod
    def gguf_config(cls, meta: GGUFMeta, cfg: ModelConfig) -> None:
        """Fill the family's settings of ``cfg`` from a GGUF's metadata (in place; llama.cpp's keys,
        and its defaults where a key is absent). The loader has read the shared fields."""

    @classmethod
    def gguf_weights(cls, weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
        """The GGUF's tensors (named by ``gguf_tensors``) with what llama.cpp's converter did to them
        undone, under the names ``build`` takes."""
        return cls.hf_weights(weights, cfg)

    @classmethod
    def attention_scale(cls, cfg: ModelConfig) -> float:
        return cfg.head_dim**-0.5

    @classmethod
    def attention_softcap(cls, cfg: ModelConfig) -> float | None:
        """``cap * tanh(scores / cap)`` on every layer's attention scores, or None."""
        return None

    @classmethod
    def build(cls, b: Builder) -> CausalNet:
        raise NotImplementedError

    def attention_sinks(self) -> list[torch.Tensor | None] | None:
        """Each layer's attention sinks (its ``attn.sinks``), for the backend; None where no layer has any."""
        sinks = [getattr(getattr(L, "attn", None), "sinks", None) for L in self.layers]
        return sinks if any(s is not None for s in sinks) else None

    # -- the forward ------------------------------------------------------------------------------
    decode_plan = None  # the one-kernel-call decode of every layer (families with ``one_call.OneCallDecode``)

    def dense_embedding(self) -> None:
        """Make the embedding a dense table (``torch.compile`` traces ``F.embedding``)."""
        self.embed.densify(self.norm.weight.device)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The last layer's output (before the final norm), ``[T, hidden]``: by default the embedding,
        then each layer with the positions' rotary tables (``self.rotary``) and the collectives; a
        family whose layers need more (Gemma's local rotary, Llama's fused kernels) overrides it."""
        h = self.embed(input_ids)
        cs = self.rotary.lookup(positions)
        for L in self.layers:
            h = L(h, positions, cs, self.comm)
        return h

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logit_index: torch.Tensor,
        pool_index: torch.Tensor | None = None,
        greedy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits of the ``logit_index`` rows; with ``pool_index``, also those rows' final-norm
        hidden states (float32 ``[rows, hidden]``, what the LM head reads: pooling). ``greedy``: the
        rows' greedy tokens instead of their logits (``LMHead.greedy``; the caller checked
        ``LMHead.greedy_in_kernel``)."""
        h = self.hidden(input_ids, positions)
        if greedy:
            return self.lm_head.greedy(self.norm(h[logit_index]))
        logits = self.lm_head(self.norm(h[logit_index]))
        if pool_index is None:
            return logits
        # Under tensor parallel ``h`` is whole on every rank (the last all-reduce), as is the norm.
        return logits, self.norm(h[pool_index]).float()


def stack_experts(b: Builder, prefix: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up [E, 2I, H], down [E, H, I])`` of per-expert ``{prefix}.{e}.gate_proj/up_proj/down_proj``
    tensors, in the model dtype (routed experts run dense)."""
    gate_up = [
        torch.cat([dense(b.take(f"{prefix}.{e}.{p}_proj.weight")) for p in ("gate", "up")]) for e in range(n)
    ]
    down = [dense(b.take(f"{prefix}.{e}.down_proj.weight")) for e in range(n)]
    return b.cast(torch.stack(gate_up)), b.cast(torch.stack(down))


class Projections:
    """A decoder layer's four projections by their fused names (``qkv``, ``o``, ``gate_up``,
    ``down``: the ``Linear``s that LoRA (``model/lora.py``) puts its deltas on). A layer whose MLP is
    routed experts has no ``gate_up``/``down`` ``Linear``: asking for them says so."""

    @property
    def qkv(self) -> Linear:
        return self.attn.qkv

    @property
    def o(self) -> Linear:
        return self.attn.o

    @property
    def gate_up(self) -> Linear:
        return self._mlp_linear("gate_up")

    @property
    def down(self) -> Linear:
        return self._mlp_linear("down")

    def _mlp_linear(self, name: str) -> Linear:
        lin = getattr(self.mlp, name)
        if not isinstance(lin, Linear):  # the engine refuses LoRA on such a model first (compat.py's row)
            raise TypeError(f"LoRA adapters do not apply to routed experts ({self.mlp.__class__.__name__})")
        return lin


class PreNormLayer(Projections, nn.Module):
    """The Llama-style block on the shared layers: ``h += attn(norm(h)); h += mlp(norm(h))`` (the
    MLP a ``GatedMLP`` or a ``MoE``), with the TP all-reduces after each block."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, in_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.in_norm, self.post_norm = in_norm, post_norm

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cs, comm: Comm) -> torch.Tensor:
        h = h + comm.all_reduce(self.attn(self.in_norm(h), positions, cs))
        return h + comm.all_reduce(self.mlp(self.post_norm(h)))
