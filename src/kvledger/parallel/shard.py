"""Megatron-style sharding of a checkpoint (HF names, as the families take them) for one tensor-parallel rank.

QKV and gate/up are split by output (column-parallel), O and down by input (row-parallel, one
all-reduce each); the embedding and the LM head by vocabulary (the embedding's partial lookups are
all-reduced, the LM head's logits all-gathered; the vocabulary is padded to a multiple of the TP size).
Query heads are split evenly; KV heads too when they divide, else each rank keeps the one KV head its
query heads read (replication, as vLLM does when the TP size exceeds the KV head count). Routed
experts are split by their hidden width like the MLP; the router is replicated.
"""

from __future__ import annotations

import dataclasses

import torch

from ..compat import refusal_error
from ..errors import ModelLoadError
from ..model.config import ModelConfig
from ..model.quantized import BlockWeight, Weight


def check_tp(cfg: ModelConfig, tp: int) -> None:
    if tp == 1:
        return
    from ..model.models.registry import family_for

    family = family_for(cfg.arch)
    if family is not None and not family.supports_tp:
        raise refusal_error("unsharded_family", "tp", detail=cfg.arch, error=ModelLoadError)
    if cfg.num_experts and cfg.moe_intermediate_size % tp:
        raise ModelLoadError(f"--tp-size {tp} does not divide the experts' MLP size {cfg.moe_intermediate_size}")
    if cfg.num_heads % tp:
        raise ModelLoadError(
            f"--tp-size {tp} does not divide the {cfg.num_heads} attention heads of this model"
        )
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ModelLoadError(
            f"--tp-size {tp} neither divides nor is a multiple of the {cfg.num_kv_heads} KV heads of this model"
        )
    if cfg.intermediate_size % tp:
        raise ModelLoadError(f"--tp-size {tp} does not divide the MLP size {cfg.intermediate_size}")


def local_config(cfg: ModelConfig, rank: int, tp: int) -> ModelConfig:
    """The shapes one rank computes with (heads, KV heads, MLP width)."""
    if tp == 1:
        return cfg
    kv = cfg.num_kv_heads // tp if cfg.num_kv_heads % tp == 0 else 1
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=kv,
        intermediate_size=cfg.intermediate_size // tp,
        moe_intermediate_size=cfg.moe_intermediate_size // tp,
    )


def vocab_slice(vocab: int, rank: int, tp: int) -> tuple[int, int]:
    per = -(-vocab // tp)
    return rank * per, (rank + 1) * per


def shard_weights(cfg: ModelConfig, weights: dict[str, Weight], rank: int, tp: int) -> dict[str, Weight]:
    """This rank's slices of ``weights`` (HF naming), in place of the full tensors."""
    if tp == 1:
        return weights
    d = cfg.head_dim
    hq = cfg.num_heads // tp
    q_rows = slice(rank * hq * d, (rank + 1) * hq * d)
    if cfg.num_kv_heads % tp == 0:
        hk = cfg.num_kv_heads // tp
        kv_rows = slice(rank * hk * d, (rank + 1) * hk * d)
    else:  # replicate: the KV head this rank's query heads belong to
        h = rank * cfg.num_kv_heads // tp
        kv_rows = slice(h * d, (h + 1) * d)
    ff = cfg.intermediate_size // tp
    ff_rows = slice(rank * ff, (rank + 1) * ff)
    eff = cfg.moe_intermediate_size // tp  # each routed expert's slice (the router is replicated)
    expert_rows = slice(rank * eff, (rank + 1) * eff)
    a, b = vocab_slice(cfg.vocab_size, rank, tp)

    def vocab_rows(t: Weight) -> Weight:
        if isinstance(t, BlockWeight):
            return t.pad_rows(b).rows(slice(a, b))
        pad = b - t.shape[0]
        if pad > 0:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
        return t[a:b].clone()

    out = {}
    for name, t in weights.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _rows(t, q_rows)
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            t = _rows(t, kv_rows)
        elif name.endswith("o_proj.weight"):
            t = _cols(t, q_rows)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            t = _rows(t, expert_rows if ".experts." in name else ff_rows)
        elif name.endswith("down_proj.weight"):
            t = _cols(t, expert_rows if ".experts." in name else ff_rows)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = vocab_rows(t)
        out[name] = t if isinstance(t, BlockWeight) else t.contiguous()
    return out


def _rows(t: Weight, rows: slice) -> Weight:
    return t.rows(rows) if isinstance(t, BlockWeight) else t[rows]


def _cols(t: Weight, cols: slice) -> Weight:
    """Columns of a row-parallel weight; blocks stay blocks where the split falls on whole blocks."""
    if isinstance(t, BlockWeight):
        kept = t.cols(cols)
        return kept if kept is not None else t.dequantize()[:, cols]
    return t[:, cols]
