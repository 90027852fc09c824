"""The builder that turns loaded weights into a family's layers (``Builder``: fused ``Linear``s,
norms, attention, gated MLPs, rotary tables, the vocabulary ends, tied or not), and routed experts'
stacked tensors (``stack_experts``). A family's ``CausalNet.build`` (``base.py``) takes one."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ...comm import Comm
from ...errors import ModelLoadError
from ...kernels.gguf_weight import GGUF_KERNEL_KINDS, GgufWeight
from ..config import ModelConfig
from ..layers import Attention, GatedMLP, LMHead, RMSNorm, Rotary, VocabEmbedding
from ..linear import Linear, repacked_at_load
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
        parts = [self.take(n + ".weight") for n in names]
        w = cat_rows(parts, apart=self.quantization is not None and repacked_at_load(parts))
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


def stack_experts(b: Builder, prefix: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up [E, 2I, H], down [E, H, I])`` of per-expert ``{prefix}.{e}.gate_proj/up_proj/down_proj``
    tensors, in the model dtype (routed experts run dense)."""
    gate_up = [
        torch.cat([dense(b.take(f"{prefix}.{e}.{p}_proj.weight")) for p in ("gate", "up")]) for e in range(n)
    ]
    down = [dense(b.take(f"{prefix}.{e}.down_proj.weight")) for e in range(n)]
    return b.cast(torch.stack(gate_up)), b.cast(torch.stack(down))
