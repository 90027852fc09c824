"""PD under tensor parallelism: the wire carries every KV head, rank 0 is the only endpoint.

Each rank holds a KV buffer of its own heads (``parallel/shard.py``), but a transfer's bytes are
always the model's whole ``[2, layers, kv_heads, count, head_dim]`` block (``Layout.kv_heads`` is the
model's), so a prefill and a decode server of different TP sizes (1 and 2, 2 and 1, ...) meet without
knowing each other's split: each side splits or joins heads on its own. The ranks exchange heads
through the group, in step order, inside the step's connector metadata (``PDMeta``; the hierarchical
cache's seam):

* prefill: a finished request's KV is *collected* in the next step -- every rank cuts its heads at the
  request's locations (only the first rank holding a replicated head sends it) and rank 0 joins them
  (``parallel.executor.gather``); rank 0's I/O thread then sends the joined block as KV frames.
* decode: the frames are *staged* on rank 0 (one block per request, exactly its claimed tokens: a
  request waiting for KV has its pages reserved already, so the staging is bounded by the pool's size
  times the TP size, and ``TransferStats.staged_bytes`` names what is staged now); when the last
  frame is in, the next step *places* the block: it travels in the step's broadcast and every rank
  writes its heads into the request's pages before that step's forward.

Between the collect and the send, and between the stage and the place, the request holds its pages
in the books as without TP (``kv sending`` / ``waiting for kv``); the staged blocks are plain tensors
that die with their job (an abort drops them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..connector import KVConnector
from ..memory.pools import KVBuffer
from .kv_copy import block, place

# Every rank's object, in rank order, on rank 0 (None elsewhere): ``parallel.executor.gather``.
Gather = Callable[[object], list | None]


@dataclass
class PDMeta:
    """What every rank does with its heads in one step (broadcast inside the ``SchedulerOutput``)."""

    kv_heads: int  # the model's KV heads: the wire's layout
    collect: list[torch.Tensor] = field(default_factory=list)  # prefill: locations to send to rank 0
    place: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # decode: (locs, block)


def heads_of(kv_heads: int, rank: int, tp: int) -> tuple[slice, bool]:
    """The model's KV heads rank ``rank`` of ``tp`` holds, and whether it is their first holder (a
    head replicated over several ranks is sent by one). Mirrors ``shard_weights``."""
    if kv_heads % tp == 0:
        per = kv_heads // tp
        return slice(rank * per, (rank + 1) * per), True
    h = rank * kv_heads // tp  # replicated: the head this rank's query heads read
    return slice(h, h + 1), rank == 0 or (rank - 1) * kv_heads // tp != h


class RankHeads:
    """One rank's part of a step's ``PDMeta`` (every rank runs it, rank 0 inside its connector)."""

    def __init__(self, rank: int, tp: int, gather: Gather):
        self.rank, self.tp, self.gather = rank, tp, gather

    def apply(self, meta: PDMeta | None, kv: KVBuffer) -> list[torch.Tensor]:
        """Place this rank's heads of the staged blocks, then send its heads of the locations to
        collect; returns the joined whole-head blocks on rank 0 (in ``meta.collect``'s order)."""
        if meta is None:
            return []
        heads, first = heads_of(meta.kv_heads, self.rank, self.tp)
        for locs, blk in meta.place:
            place(kv, locs, blk[:, :, heads])
        if not meta.collect:
            return []
        parts = self.gather((heads, [block(kv, locs) if first else None for locs in meta.collect]))
        if parts is None:  # not rank 0
            return []
        out = []
        for i, locs in enumerate(meta.collect):
            mine = parts[0][1][i]
            whole = mine.new_empty(2, mine.shape[1], meta.kv_heads, len(locs), mine.shape[4])
            for sl, blocks in parts:
                if blocks is not None and blocks[i] is not None:
                    whole[:, :, sl] = blocks[i]
            out.append(whole)
        return out


class PDWorker(KVConnector):
    """The PD connector's worker side on ranks 1..N-1: its heads in and out (``RankHeads``)."""

    def __init__(self, rank: int, tp: int, gather: Gather):
        self.heads = RankHeads(rank, tp, gather)

    def start_load_kv(self, meta: PDMeta | None, kv_buffer: KVBuffer) -> None:
        self.heads.apply(meta, kv_buffer)

    def close(self) -> None:
        return None
