"""PD under tensor parallelism: the wire carries every KV head, rank 0 is the only endpoint.

Each rank holds a KV buffer of its own heads (``parallel/shard.py``), but a transfer's bytes are
always the model's whole ``[2, layers, kv_heads, count, head_dim]`` block (``Layout.kv_heads`` is the
model's), so a prefill and a decode server of different TP sizes (1 and 2, 2 and 1, ...) meet without
knowing each other's split: each side splits or joins heads on its own. The ranks exchange heads
through the group, in step order, inside the step's connector metadata (``PDMeta``; the hierarchical
cache's seam):

* prefill: a finished request's KV is *collected* in the next step -- every rank cuts its heads at the
  request's locations, a gather brings them to rank 0, which joins them (a replicated head taken from
  its first holder); rank 0's I/O thread then sends the joined block as KV frames.
* decode: the frames are *staged* on rank 0 (one block per request, exactly its claimed tokens: a
  request waiting for KV has its pages reserved already, so the staging is bounded by the pool's size
  times the TP size, and ``TransferStats.staged_bytes`` names what is staged now); when the last
  frame is in, the next step *places* the block: the step's meta names the locations, rank 0 scatters
  each rank its heads, and every rank writes them into the request's pages before that step's forward.

The K/V moves by raw tensor collectives over gloo (``comm.gather_tensors`` /
``scatter_tensors``), never pickled inside the step's broadcast: that was 3-10x slower per token (bench/RESULTS.md).

Between the collect and the send, and between the stage and the place, the request holds its pages
in the books as without TP (``kv sending`` / ``waiting for kv``); the staged blocks are plain tensors
that die with their job (an abort drops them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm import gather_tensors, scatter_tensors
from ..connector import KVConnector
from ..memory.pools import KVBuffer
from .kv_copy import block, place


@dataclass
class PDMeta:
    """What every rank does with its heads in one step (broadcast inside the ``SchedulerOutput``:
    locations only; the K/V moves by tensor collectives, never pickled)."""

    kv_heads: int  # the model's KV heads: the wire's layout
    collect: list[torch.Tensor] = field(default_factory=list)  # prefill: locations to send to rank 0
    place: list[torch.Tensor] = field(default_factory=list)  # decode: locations of rank 0's staged blocks


def heads_of(kv_heads: int, rank: int, tp: int) -> tuple[slice, bool]:
    """The model's KV heads rank ``rank`` of ``tp`` holds, and whether it is their first holder (a
    head replicated over several ranks is sent by one). Mirrors ``shard_weights``."""
    if kv_heads % tp == 0:
        per = kv_heads // tp
        return slice(rank * per, (rank + 1) * per), True
    h = rank * kv_heads // tp  # replicated: the head this rank's query heads read
    return slice(h, h + 1), rank == 0 or (rank - 1) * kv_heads // tp != h


class RankHeads:
    """One rank's part of a step's ``PDMeta`` (every rank runs it, rank 0 inside its connector).
    ``comm.gather_tensors`` / ``scatter_tensors`` move the heads (gloo, raw tensors)."""

    def __init__(self, rank: int, tp: int):
        self.rank, self.tp = rank, tp
        self.gather, self.scatter = gather_tensors, scatter_tensors

    def apply(self, meta: PDMeta | None, kv: KVBuffer, staged: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Place this rank's heads of rank 0's ``staged`` blocks (one per ``meta.place``), then send
        its heads of the locations to collect; returns the joined whole-head blocks on rank 0 (in
        ``meta.collect``'s order)."""
        if meta is None:
            return []
        heads = [heads_of(meta.kv_heads, r, self.tp) for r in range(self.tp)]
        mine = heads[self.rank][0]
        local = mine.stop - mine.start
        layers, _, _, dim = kv.k.shape
        for i, locs in enumerate(meta.place):
            out = torch.empty(2, layers, local, len(locs), dim, dtype=kv.k.dtype)
            parts = None if staged is None else [staged[i][:, :, sl].contiguous() for sl, _ in heads]
            self.scatter(parts, out)
            place(kv, locs, out)
        whole = []
        for locs in meta.collect:
            parts = self.gather(block(kv, locs))
            if parts is None:  # not rank 0
                continue
            joined = parts[0].new_empty(2, layers, meta.kv_heads, len(locs), dim)
            for (sl, first), part in zip(heads, parts, strict=True):
                if first:  # a replicated head is taken from its first holder
                    joined[:, :, sl] = part
            whole.append(joined)
        return whole


class PDWorker(KVConnector):
    """The PD connector's worker side on ranks 1..N-1: its heads in and out (``RankHeads``)."""

    def __init__(self, rank: int, tp: int):
        self.heads = RankHeads(rank, tp)

    def start_load_kv(self, meta: PDMeta | None, kv_buffer: KVBuffer) -> None:
        self.heads.apply(meta, kv_buffer)

    def close(self) -> None:
        return None
