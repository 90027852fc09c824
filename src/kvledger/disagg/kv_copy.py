"""Copies between a request's pages and a transfer's bytes.

Token-granular: a sender and a receiver may use different page sizes (and the receiver's own prefix
cache decides where the transfer starts), so a run of positions is gathered into one contiguous
``[2, layers, kv_heads, count, head_dim]`` block and scattered into the receiver's own locations.
"""

from __future__ import annotations

import warnings

import torch

from ..memory.pools import KVBuffer
from .wire import Layout


def layout_of(kv: KVBuffer) -> Layout:
    layers, heads, _, dim = kv.k.shape
    return Layout(layers, heads, dim, str(kv.k.dtype).removeprefix("torch."), kv.k.element_size())


def locations(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Cache locations of sequence positions ``[start, end)`` of a request with ``pages``."""
    pos = torch.arange(start, end)
    return torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size + pos % page_size


def gather(kv: KVBuffer, locs: torch.Tensor) -> torch.Tensor:
    """K/V at ``locs`` as one contiguous block of bytes (uint8, ready for the wire)."""
    block = torch.stack((kv.k[:, :, locs, :], kv.v[:, :, locs, :]))
    return block.contiguous().view(torch.uint8).reshape(-1)


def scatter(kv: KVBuffer, locs: torch.Tensor, payload, layout: Layout) -> None:
    """Write a received block (``payload``: bytes-like of exactly ``len(locs)`` tokens) to ``locs``."""
    dtype = kv.k.dtype
    with warnings.catch_warnings():  # a received frame is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(payload, dtype=torch.uint8)
    block = raw.view(dtype).reshape(2, layout.num_layers, layout.kv_heads, len(locs), layout.head_dim)
    kv.k[:, :, locs, :] = block[0]
    kv.v[:, :, locs, :] = block[1]
