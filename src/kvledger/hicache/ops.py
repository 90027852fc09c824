"""What the tiers' policy (rank 0) tells every rank to move: plain data, shipped to the other
tensor-parallel ranks in the step's connector metadata and applied there in the order it was decided.

Rank 0 applies each op the moment its policy decides it (``Tiers.do``); the other ranks apply the
same ops at the start of the next step they run, before its page-table writes and its forward. That
is early enough: between the decision and that step no forward runs on any rank, so each rank's L1
still holds what rank 0's held (L1 changes only in forwards and through these ops, in order).

File ops (``Store``, ``Read``) run on each rank's I/O thread, under that rank's own keys; an op is done
when every rank has reported it (``TierReport``), and a read's result is the fewest pages any rank read
(all ranks or none, page by page).

The ops are tagged msgspec structs so that the step's frame to the other ranks decodes each into its
own class (``parallel/frames.py``; a union of untagged classes could not be told apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class Save(msgspec.Struct, tag="save"):
    """L1 -> L2, every layer: ``host_pages[i]`` gets the KV of ``l1_pages[i]``."""

    l1_pages: list[int]
    host_pages: list[int]


class Restore(msgspec.Struct, tag="restore"):
    """L2 -> L1, every layer (a demoted session's next turn)."""

    host_pages: list[int]
    l1_pages: list[int]


class Store(msgspec.Struct, tag="store"):
    """L2 -> L3: ``host_pages`` are the last pages of ``tokens`` (a radix node's path from the root);
    each rank writes its heads under its own chained keys of those tokens."""

    id: int
    tokens: list[int]
    host_pages: list[int]


class Read(msgspec.Struct, tag="read"):
    """L3 -> L2: pages ``start_page ..`` of ``tokens`` into ``host_pages`` (a prefetch)."""

    id: int
    tokens: list[int]
    start_page: int
    host_pages: list[int]


class Cancel(msgspec.Struct, tag="cancel"):
    """Stop ``Read`` ``id`` at its next page (its request ended)."""

    id: int


TierOp = Save | Restore | Store | Read | Cancel

# One rank's finished file ops since its last report: (op id, pages read; 0 for a store).
TierReport = list[tuple[int, int]]


@dataclass(slots=True)
class Load:
    """A load-back of this step: ``host_pages`` into the request's fresh ``l1_pages``, layer by
    layer in the forward (``wait_for_layer_load``)."""

    rid: str
    host_pages: list[int]
    l1_pages: list[int]


@dataclass(slots=True)
class HiCacheMeta:
    """The step's connector metadata: the ops for the ranks other than 0 (rank 0 has applied them),
    the step's load-backs (every rank), and whether file ops are in flight, so that after the
    forward every rank reports its finished ones (one gather to rank 0; only with tensor parallelism)."""

    ops: list[TierOp] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    gather: bool = False
