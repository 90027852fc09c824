"""LoRA adapters of the base model (S-LoRA's serving: many adapters, one base, one forward).

An adapter is what peft saves (read and checked by ``lora_adapter.py``): ``adapter_config.json``
(rank, alpha, target modules) and ``adapter_model.safetensors`` (``...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]``). Its delta on a projection is ``scale * (x @ A.T) @ B.T``, computed in
float32 and added to the base projection's output, whatever that is (bf16 GEMM, the quantized
kernels over a GGUF file's blocks, float32): the base weights are never touched, so adapters of
one base serve side by side, and side by side with the base model.

Each base projection the model runs fused (QKV, gate/up) gets the adapter's per-module matrices
stacked: ``A`` ``[sum r, in]`` and ``B`` ``[out, sum r]`` block-diagonal over the fused output's
segments (a module the adapter does not target contributes no rows). ``scale`` is folded into ``B``.

A forward's rows carry an adapter each (``LoraBatch``: the base model, or one adapter; from the
scheduled requests). Each adapted projection then adds, for each adapter present, its delta on that
adapter's rows: the rows are gathered per adapter and run through two matmuls (grouped; on this CPU
faster than a bmm over per-row gathered A/B at 32 rows: bench/lora_kernels.py, bench/RESULTS.md).
The batch reaches the projections through ``active`` (set around the forward by the runner), so
the model's forward code is unchanged; forwards that bypass the projections (the one-call C++
decode, compiled graphs) are not taken when a batch has adapter rows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import ValidationError
from .lora_adapter import FUSED, LoraAdapter, bad_adapter


class LoraLayer:
    """The adapters' deltas on one (possibly fused) projection: ``segments`` are the modules its
    output stacks, in order, with their widths."""

    def __init__(self, layer: int, segments: Sequence[tuple[str, int]], in_features: int, device, dtype):
        self.layer = layer
        self.segments = list(segments)
        self.in_features = in_features
        self.out_features = sum(w for _, w in segments)
        self.device = device
        self.dtype = dtype
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # adapter -> (A [R, in], B [out, R])
        self._stacks: OrderedDict[tuple[str, ...], tuple | None] = OrderedDict()

    def stacked(self, adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``adapter``'s A and block-diagonal B over this projection's segments (None: untouched)."""
        As, Bs = [], []
        start = 0
        for module, width in self.segments:
            ab = adapter.weights.get((self.layer, module))
            if ab is not None:
                a, b = ab
                if a.shape[1] != self.in_features or b.shape[0] != width:
                    raise bad_adapter(
                        f"LoRA adapter {adapter.name!r}: layer {self.layer} {module} is [{b.shape[0]} x "
                        f"{a.shape[1]}], the base model's is [{width} x {self.in_features}]"
                    )
                As.append(a)
                full = torch.zeros(self.out_features, a.shape[0])
                full[start : start + width] = b
                Bs.append(full)
            start += width
        if not As:
            return None
        return (
            torch.cat(As).to(self.device).contiguous(),
            torch.cat(Bs, dim=1).to(self.device).contiguous(),
        )

    def _stack(self, names: tuple[str, ...]):
        """The adapters ``names``' A and B side by side (``[sum R, in]``, ``[out, sum R]``) and which
        adapter each of the ``sum R`` columns belongs to; None when none targets this projection.
        Kept for the last few adapter sets (a batch's set changes only as requests come and go)."""
        if names in self._stacks:
            self._stacks.move_to_end(names)
            return self._stacks[names]
        As, Bs, cols = [], [], []
        for i, name in enumerate(names):
            ab = self.weights.get(name)
            if ab is not None:
                As.append(ab[0])
                Bs.append(ab[1])
                cols += [i] * ab[0].shape[0]
        st = None
        if As:
            col = torch.tensor(cols, dtype=torch.int64, device=self.device)
            st = (torch.cat(As), torch.cat(Bs, dim=1).contiguous(), col, tuple(cols))
        self._stacks[names] = st
        if len(self._stacks) > STACKS_KEPT:
            self._stacks.popitem(last=False)
        return st

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = current()
        if batch is None:
            return y
        st = self._stack(batch.names)
        if st is None:
            return y
        a, b, col, key = st
        # Every row through every present adapter's A (one matmul), each row keeping only its own
        # adapter's columns (the base model's rows: none), then one matmul through the Bs.
        d = F.linear(F.linear(x.float(), a) * batch.mask(col, key), b)
        if y.dtype == torch.float32:
            return y.add_(d)
        return y.copy_(y.float().add_(d))  # the delta added in float32, rounded once (base rows: exact)


STACKS_KEPT = 4


@dataclass
class LoraBatch:
    """A forward's adapters: ``names`` those present (in order of first row), ``owner`` each row's
    index into them (-1: the base model)."""

    names: tuple[str, ...]
    owner: torch.Tensor
    _masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, per_req: Sequence[str | None], lens: Sequence[int], device) -> LoraBatch | None:
        """From each request's adapter (None: the base model) and token count; None without adapters."""
        if not any(per_req):
            return None
        names = tuple(dict.fromkeys(n for n in per_req if n is not None))
        index = {n: i for i, n in enumerate(names)}
        owner = [index[n] if n is not None else -1 for n, k in zip(per_req, lens) for _ in range(k)]
        return cls(names, torch.tensor(owner, dtype=torch.int64, device=device))

    def mask(self, col: torch.Tensor, key: tuple) -> torch.Tensor:
        """``[rows, columns]`` 1.0 where the column belongs to the row's adapter (once per layout:
        the layers of one model share a handful)."""
        m = self._masks.get(key)
        if m is None:
            m = self._masks[key] = (self.owner[:, None] == col[None, :]).float()
        return m


_local = threading.local()  # engines in one process step in their own threads


def current() -> LoraBatch | None:
    return getattr(_local, "batch", None)


@contextmanager
def active(batch: LoraBatch | None) -> Iterator[None]:
    """``batch``'s adapters apply to the adapted projections' calls inside this block."""
    prev = current()
    _local.batch = batch
    try:
        yield
    finally:
        _local.batch = prev


class LoraSet:
    """The adapters a model serves: their LoRA layers on the model's projections, added and removed
    as adapters are loaded and unloaded."""

    def __init__(self, max_rank: int | None):
        self.max_rank = max_rank
        self.adapters: dict[str, LoraAdapter] = {}
        self.layers: list[LoraLayer] = []

    def attach(self, model) -> None:
        """Put LoRA layers on ``model``'s projections (again after a weight update: a new model),
        with every adapter loaded so far."""
        net = model.net
        cfg = net.cfg
        widths = {
            "q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
            "v_proj": cfg.num_kv_heads * cfg.head_dim, "o_proj": cfg.hidden_size,
            "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size,
        }  # fmt: skip
        self.layers = []
        for i, L in enumerate(net.layers):
            for attr, modules in FUSED.items():
                lin = getattr(L, attr)
                lora = LoraLayer(i, [(m, widths[m]) for m in modules], lin.in_features, lin.device, lin.dtype)
                if lora.out_features != lin.out_features:
                    raise ValidationError(f"layer {i} {attr}: LoRA segments do not match the projection")
                lin.lora = lora
                self.layers.append(lora)
        for a in self.adapters.values():
            self._install(a)

    def _install(self, adapter: LoraAdapter) -> None:
        stacked = [(L, L.stacked(adapter)) for L in self.layers]  # every check before any change
        if adapter.weights and max(layer for layer, _ in adapter.weights) >= len(self.layers) // len(FUSED):
            raise bad_adapter(f"LoRA adapter {adapter.name!r} has more layers than the base model")
        for L, ab in stacked:
            L._stacks.clear()
            if ab is not None:
                L.weights[adapter.name] = ab

    def add(self, adapter: LoraAdapter) -> None:
        if adapter.name in self.adapters:
            raise ValidationError(f"a LoRA adapter named {adapter.name!r} is loaded already", param="lora_name",
                                  code="lora_exists")  # fmt: skip
        self._install(adapter)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        self.adapters.pop(name)
        for L in self.layers:
            L._stacks.clear()
            L.weights.pop(name, None)
