"""Mooncake's transfer engine as the PD data path (``--disaggregation-transfer-backend mooncake``).

The control messages stay the built-in ones (``wire.py`` over ZMQ); only the K/V bytes move through
Mooncake: each side registers its whole KV buffer once; a decode side's claim carries its engine's
session ("host:rpc_port"), the base addresses of its K and V tensors, its pool size and the pages of
the claimed positions; the prefill side writes straight from its pages into those pages
(``batch_transfer_sync_write``, TCP protocol, P2P handshake: no metadata server), then sends ``Done``.

Writes land in decode's memory without decode's I/O thread seeing them, so a decode request that
ends while its claim is open keeps its pages (ledger: ``kv sending``) until the prefill side answers
that it has stopped (its writes are synchronous in its I/O thread, so any answer comes after the
last one), or the waiting timeout passes.

What it trusts: nothing. Mooncake's engine (0.3.13) listens on every interface whatever ``host`` is
(``host`` is only what it announces: its RPC port on 0.0.0.0, its TCP data port on ``*``; the library
has no bind setting) and does not authenticate: whoever reaches those ports can read and write the
registered KV buffer. The control messages are sealed as on the built-in transport (``auth.py``), so
only a peer with the key names where prefill writes. Use this backend only on a network you trust
(or firewall its ports); a warning at start says so.

Optional: ``pip install 'kvledger[mooncake]'`` (``mooncake-transfer-engine-non-cuda``; it needs the
Debian package ``libibverbs1``).
"""

from __future__ import annotations

import logging

import torch

from ..errors import ValidationError
from ..memory.pools import KVBuffer
from .wire import Layout, MooncakeTarget

log = logging.getLogger("kvledger.disagg")

BATCH_BLOCKS = 1024  # blocks per batch_transfer_sync_write call


def available() -> str | None:
    """None when Mooncake's engine imports, else why not (for the error and the test skip)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as e:  # not installed, or libibverbs.so.1 missing
        return f"{e} (pip install 'kvledger[mooncake]'; it needs the system package libibverbs1)"
    return None


class MooncakeData:
    """One side's Mooncake engine with this process's KV buffer registered."""

    def __init__(self, kv: KVBuffer, host: str):
        why = available()
        if why is not None:
            raise ValidationError(f"the mooncake transfer backend is not installed: {why}",
                                  param="disaggregation_transfer_backend")  # fmt: skip
        from mooncake.engine import TransferEngine

        self.kv = kv
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise ValidationError(f"mooncake: cannot start a transfer engine on {host}",
                                  param="disaggregation_bind_host")  # fmt: skip
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        for t in (kv.k, kv.v):
            if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
                raise ValidationError(
                    "mooncake: cannot register the KV buffer", param="disaggregation_transfer_backend"
                )
        log.info("PD: mooncake transfer engine at %s (%.0f MiB of KV registered)",
                 self.session, 2 * kv.k.numel() * kv.k.element_size() / 2**20)  # fmt: skip
        log.warning("PD: Mooncake's transfer engine listens on every interface and authenticates nothing: "
                    "whoever reaches its ports can read and write this KV buffer (trusted networks only)")  # fmt: skip

    def target(self, pages: list[int], page_size: int) -> MooncakeTarget:
        """What a claim tells the prefill side about where to write (decode)."""
        return MooncakeTarget(
            self.session, self.kv.k.data_ptr(), self.kv.v.data_ptr(), self.kv.k.shape[2], page_size, pages
        )

    def write(self, src_locs: torch.Tensor, target: MooncakeTarget, start: int, layout: Layout) -> int:
        """Write positions ``start..`` (``src_locs`` here) into the target's pages; Mooncake's status
        (0: done). One block per (K or V, layer, KV head, run of locations contiguous on both sides)."""
        ps = target.page_size
        pos = torch.arange(start, start + len(src_locs))
        first_page = start // ps
        pages = torch.tensor(target.pages, dtype=torch.long)
        dst_locs = pages[pos // ps - first_page] * ps + pos % ps
        runs = _runs(src_locs.tolist(), dst_locs.tolist())
        row = layout.head_dim * layout.itemsize
        n_src, n_dst = self.kv.k.shape[2], target.num_locations
        srcs, dsts, lens = [], [], []
        for src_base, dst_base in (
            (self.kv.k.data_ptr(), target.k_base),
            (self.kv.v.data_ptr(), target.v_base),
        ):
            for plane in range(layout.num_layers * layout.kv_heads):  # (layer, head) planes of [N, D]
                s0 = src_base + plane * n_src * row
                d0 = dst_base + plane * n_dst * row
                for s, d, n in runs:
                    srcs.append(s0 + s * row)
                    dsts.append(d0 + d * row)
                    lens.append(n * row)
        # Bounded batches: one batch of tens of thousands of blocks overflows the TCP transport's
        # queue (measured: "TCP lane queue-full", status -1, at ~20k blocks).
        for i in range(0, len(srcs), BATCH_BLOCKS):
            j = i + BATCH_BLOCKS
            rc = self.engine.batch_transfer_sync_write(target.session, srcs[i:j], dsts[i:j], lens[i:j])
            if rc != 0:
                return rc
        return 0


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(src_start, dst_start, length)`` where both location lists count up by one."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            a, b, n = out[-1]
            out[-1] = (a, b, n + 1)
        else:
            out.append((s, d, 1))
    return out
