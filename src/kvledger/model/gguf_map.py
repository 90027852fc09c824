"""llama.cpp's GGUF layout as the model families read it.

A family (``models/``) says which llama.cpp tensor (``gguf.MODEL_TENSOR``) is which of its HF names
(its ``gguf_tensors`` table, usually ``DECODER`` with a few entries changed), reads its own settings
from the file's metadata (``GGUFMeta``: keys as ``gguf.Keys`` spells them, llama.cpp's defaults where
a key is absent), and undoes what llama.cpp's converter (``convert_hf_to_gguf.py``) did to its
tensors: the Llama converter's q/k row permutation (``unpermute_attention``), Gemma's norms stored as
``1 + w``, Phi-3's fused projections. The loader (``loader.py``) stays generic: it names every tensor
through the family's table (``tensor_names``), cuts llama.cpp's stacked 3-D expert tensors into one
matrix per expert, and calls the family's hooks.
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import torch

from ..errors import ModelLoadError
from .config import FULL, SLIDING, ModelConfig
from .quantized import BlockWeight, Weight

T = gguf.MODEL_TENSOR
Keys = gguf.Keys

# llama.cpp tensor -> HF name (without .weight/.bias): ``{bid}`` the layer, ``{xid}`` the expert of a
# stacked [experts, rows, cols] tensor (the loader gives each expert its matrix under its own name).
DECODER: dict[gguf.MODEL_TENSOR, str] = {
    T.TOKEN_EMBD: "model.embed_tokens",
    T.OUTPUT_NORM: "model.norm",
    T.OUTPUT: "lm_head",
    T.ATTN_NORM: "model.layers.{bid}.input_layernorm",
    T.ATTN_Q: "model.layers.{bid}.self_attn.q_proj",
    T.ATTN_K: "model.layers.{bid}.self_attn.k_proj",
    T.ATTN_V: "model.layers.{bid}.self_attn.v_proj",
    T.ATTN_OUT: "model.layers.{bid}.self_attn.o_proj",
    T.ATTN_Q_NORM: "model.layers.{bid}.self_attn.q_norm",
    T.ATTN_K_NORM: "model.layers.{bid}.self_attn.k_norm",
    T.FFN_NORM: "model.layers.{bid}.post_attention_layernorm",
    T.FFN_GATE: "model.layers.{bid}.mlp.gate_proj",
    T.FFN_UP: "model.layers.{bid}.mlp.up_proj",
    T.FFN_DOWN: "model.layers.{bid}.mlp.down_proj",
}
"""The Llama-style decoder's names (Llama, Mistral, Qwen2/3 and the base of every other table)."""

EXPERTS: dict[gguf.MODEL_TENSOR, str] = {
    T.FFN_GATE_INP: "model.layers.{bid}.mlp.gate",
    T.FFN_GATE_EXP: "model.layers.{bid}.mlp.experts.{xid}.gate_proj",
    T.FFN_UP_EXP: "model.layers.{bid}.mlp.experts.{xid}.up_proj",
    T.FFN_DOWN_EXP: "model.layers.{bid}.mlp.experts.{xid}.down_proj",
}
"""Routed experts: the router and the three stacked expert tensors (``ffn_{gate,up,down}_exps``)."""


def tensor_names(table: dict[gguf.MODEL_TENSOR, str], num_layers: int) -> dict[str, str]:
    """GGUF tensor names without their ``.weight``/``.bias`` (``blk.3.attn_q``) -> HF names
    (``model.layers.3.self_attn.q_proj``; a ``{xid}`` left for the loader to fill per expert)."""
    out = {}
    for tensor, hf in table.items():
        gguf_name = gguf.TENSOR_NAMES[tensor]
        if "{bid}" not in gguf_name:
            out[gguf_name] = hf
            continue
        for bid in range(num_layers):
            out[gguf_name.format(bid=bid)] = hf.format(bid=bid, xid="{xid}")
    return out


def gguf_name(tensor: gguf.MODEL_TENSOR, bid: int | None = None) -> str:
    """llama.cpp's name of ``tensor`` (of layer ``bid``), as a file holds it: ``blk.0.ffn_up_exps.weight``."""
    return gguf.TENSOR_NAMES[tensor].format(bid=bid) + ".weight"


class GGUFMeta:
    """A GGUF file's metadata and tensor names, read on demand (the tokenizer's fields are large)."""

    def __init__(self, reader: Any, path: str):
        self._fields = reader.fields
        self.path = path
        self.arch = ""
        self.arch = str(self.get(Keys.General.ARCHITECTURE))
        self.tensor_names = frozenset(t.name for t in reader.tensors)

    def get(self, key: str, default: Any = None) -> Any:
        """Field ``key`` (a ``gguf.Keys`` template: ``{arch}`` is the file's architecture) or ``default``."""
        field = self._fields.get(key.format(arch=self.arch))
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{os.path.basename(self.path)}: GGUF metadata lacks {key.format(arch=self.arch)}")
        return value

    def sliding_layers(self, num_layers: int, every: int) -> list[str]:
        """Each layer's type as llama.cpp reads it: ``attention.sliding_window_pattern`` as one flag
        per layer (true: sliding) or as a period N (the last of every N layers is full), else the
        family's period ``every``."""
        pattern = self.get(Keys.Attention.SLIDING_WINDOW_PATTERN, every)
        if isinstance(pattern, list):
            if len(pattern) != num_layers:
                raise ModelLoadError(
                    f"{os.path.basename(self.path)}: sliding_window_pattern has {len(pattern)} entries "
                    f"for {num_layers} layers"
                )
            return [SLIDING if p else FULL for p in pattern]
        n = int(pattern)
        return [SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(num_layers)]


def unpermute_qk(w: Weight, n_head: int) -> Weight:
    """Undo llama.cpp's q/k row permutation (its Llama converter interleaves the rotary halves of each
    head for its own RoPE); a block weight's rows are reordered whole."""
    if isinstance(w, BlockWeight):  # read through the order, not copied (a repack reads the file's)
        return w.interleaved(n_head)
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The permutation llama.cpp's Llama converter applies (tests write GGUF files with it)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_attention(weights: dict[str, Weight], cfg: ModelConfig) -> dict[str, Weight]:
    """Every layer's q and k projections (weights and biases) back in HF's row order."""
    out = {}
    for name, w in weights.items():
        if ".self_attn.q_proj." in name:
            w = unpermute_qk(w, cfg.num_heads)
        elif ".self_attn.k_proj." in name:
            w = unpermute_qk(w, cfg.num_kv_heads)
        out[name] = w
    return out
