"""The per-forward attention context: the model's handle (``new_handle``) names the backend, KV buffer,
batch and KV connector of the forward that is running (``attention_context``), so that each layer's
``paged_attention`` (eager, or the ``kvledger::attention`` custom op inside a compiled graph) finds
them; and the SDPA kernels a forward on CUDA may use (``sdpa_backends``)."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention import AttentionBackend, KVBuffer
from .batch import ForwardBatch

# The forward of a compiled graph cannot take a Python batch description, so the attention op finds
# its backend, KV buffer and batch here, under the handle of the model that is running (as vLLM's
# forward context). One entry per model instance; set only for the duration of one forward.
_CONTEXTS: dict[int, tuple[AttentionBackend, KVBuffer, ForwardBatch, Any]] = {}
_next_handle = itertools.count(1)


# cuDNN's attention, torch's first choice for SDPA on Hopper GPUs, builds an execution plan for each
# new shape; a decode's KV length is new at every step, so every step paid for a plan (measured on an
# H200: one stream at 10.7 tok/s, ~93 ms a token, and ~17 ms once every length had been seen). The
# flash and memory-efficient kernels take any length as it comes (and fp32 never used cuDNN).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels a forward on ``device`` may use (torch's own choice off CUDA)."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def new_handle() -> int:
    return next(_next_handle)


@contextlib.contextmanager
def attention_context(
    handle: int, backend: AttentionBackend, kv_buffer: KVBuffer, batch: ForwardBatch, connector=None
):
    """``connector``: a KV connector's worker side, told per layer (load before, save after)."""
    _CONTEXTS[handle] = (backend, kv_buffer, batch, connector)
    try:
        yield
    finally:
        del _CONTEXTS[handle]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, handle: int
) -> torch.Tensor:
    """Store k/v of ``layer`` into the KV pool and attend, with the context of model ``handle``.
    Eager forwards call the backend directly (the custom op's dispatch costs ~0.1 ms a call)."""
    if torch.compiler.is_compiling():
        return _attention_op(q, k, v, layer, handle)
    return _attend(q, k, v, layer, handle)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, handle: int) -> torch.Tensor:
    backend, kv_buffer, batch, connector = _CONTEXTS[handle]
    if connector is None:
        return backend.forward(layer, q, k, v, kv_buffer, batch)
    connector.wait_for_layer_load(layer)
    out = backend.forward(layer, q, k, v, kv_buffer, batch)
    connector.save_kv_layer(layer, kv_buffer)
    return out


@torch.library.custom_op("kvledger::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, handle: int) -> torch.Tensor:
    """``paged_attention`` inside compiled graphs. Opaque to ``torch.compile``: the KV pool is written
    as a side effect the compiler does not see, which is safe because nothing else in the graph reads
    it and each layer's call depends on the previous layer's output."""
    return _attend(q, k, v, layer, handle)


@_attention_op.register_fake
def _(q, k, v, layer, handle):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
