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


def layout_of(kv: KVBuffer, kv_heads: int | None = None) -> Layout:
    """The wire's layout over ``kv``: with ``kv_heads`` (tensor parallel: the model's, where ``kv``
    holds one rank's) the whole model's heads, else the buffer's own."""
    layers, heads, _, dim = kv.k.shape
    return Layout(layers, kv_heads or heads, dim, str(kv.k.dtype).removeprefix("torch."), kv.k.element_size())


def locations(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Cache locations of sequence positions ``[start, end)`` of a request with ``pages``."""
    pos = torch.arange(start, end)
    return torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size + pos % page_size


def block(kv: KVBuffer, locs: torch.Tensor) -> torch.Tensor:
    """The buffer's K/V at ``locs``: ``[2, layers, heads, len(locs), head_dim]`` (a copy)."""
    return torch.stack((kv.k[:, :, locs, :], kv.v[:, :, locs, :]))


def place(kv: KVBuffer, locs: torch.Tensor, blk: torch.Tensor) -> None:
    """Write a ``[2, layers, heads, len(locs), head_dim]`` block (the buffer's heads) to ``locs``."""
    kv.k[:, :, locs, :] = blk[0]
    kv.v[:, :, locs, :] = blk[1]


def gather(kv: KVBuffer, locs: torch.Tensor) -> torch.Tensor:
    """K/V at ``locs`` as one contiguous block of bytes (uint8, ready for the wire)."""
    return to_bytes(block(kv, locs))


def to_bytes(block: torch.Tensor) -> torch.Tensor:
    """A ``[2, layers, kv_heads, count, head_dim]`` block as contiguous bytes (uint8)."""
    return block.contiguous().view(torch.uint8).reshape(-1)


def from_bytes(payload, dtype: torch.dtype, layout: Layout, count: int) -> torch.Tensor:
    """A received frame (bytes-like of exactly ``count`` tokens) as a read-only block view."""
    with warnings.catch_warnings():  # a received frame is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(payload, dtype=torch.uint8)
    return raw.view(dtype).reshape(2, layout.num_layers, layout.kv_heads, count, layout.head_dim)


def scatter(kv: KVBuffer, locs: torch.Tensor, payload, layout: Layout) -> None:
    """Write a received block (``payload``: bytes-like of exactly ``len(locs)`` tokens) to ``locs``."""
    place(kv, locs, from_bytes(payload, kv.k.dtype, layout, len(locs)))
