"""What every family shares of the network: its shell (``CausalNet``: embedding, layers, final norm,
LM head, pooling) and the decoder layer's (``Projections``, the Llama-style ``PreNormLayer``). The
builder that makes the layers of loaded weights is ``builder.py``'s ``Builder``.

A family is one file with a ``CausalNet`` subclass that says how its config and weights read from a
HF checkpoint (``hf_config``, ``hf_weights``) and from llama.cpp's GGUF (``gguf_tensors``,
``gguf_config``, ``gguf_weights``), how its attention behaves per layer (``attention_scale``,
``attention_softcap``; sinks are weights: ``attention_sinks``), how it is built (``build``) and how its hidden states flow (``hidden``);
the registry (``registry.py``) maps HF ``model_type`` names (and GGUF architectures) to it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ...comm import Comm
from ..config import ModelConfig
from ..gguf_map import DECODER, GGUFMeta
from ..layers import LMHead, RMSNorm, VocabEmbedding
from ..linear import Linear
from ..quantized import Weight
from .builder import Builder


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
