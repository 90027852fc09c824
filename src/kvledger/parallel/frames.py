"""What crosses the tensor-parallel group between rank 0 and the other ranks, and how.

Every message is a tagged msgspec struct (or a plain msgspec type such as ``TierReport``), encoded as
msgpack and sent over the group's gloo connections as uint8 tensors: its length first, then its
bytes. The receiver decodes it into the exact type it expects at that point (``CommSetup``, then ``Setup``, after the
group forms, ``ToWorker`` in a worker's loop, ``Stats`` / ``TierReport`` in a gather): a frame of
another type, a malformed one or one over ``MAX_FRAME_BYTES`` raises ``FrameError`` and nothing of it
is used. Never pickle: ``broadcast_object_list`` / ``gather_object`` unpickled whatever arrived, so
whoever could write to a rank's connection ran code there.

numpy arrays (structured outputs' token bitmasks) and torch tensors (PD's locations) cross as
``Array``: a dtype from a short list, a shape and the raw bytes, checked against each other.
Connector metadata (``SchedulerOutput.connector_meta``, typed ``Any`` at the seam) crosses wrapped in
a tagged frame per kind; a kind without one is refused when it is sent, not guessed at when received.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Annotated, Any, Literal, get_args

import msgspec
import numpy as np
import torch

from ..disagg.tp import PDMeta
from ..hicache.ops import HiCacheMeta, TierReport
from ..memory import PageWrite
from ..memory.sparse_kv import SparseStep
from ..multimodal.embeds import Splice
from ..scheduler.output import ScheduledReq, SchedulerOutput
from .errors import FrameError

MAX_FRAME_BYTES = 1 << 30  # far above any step's frame; a length past it is refused before allocating


# -- what the frames hold -------------------------------------------------------------------------------


class Array(msgspec.Struct, array_like=True):
    """A numpy array or CPU tensor on the wire."""

    dtype: Literal["bool", "uint8", "int32", "int64", "float32"]
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    data: bytes


class HiCacheFrame(msgspec.Struct, tag="hicache"):
    meta: HiCacheMeta


class PDFrame(msgspec.Struct, tag="pd"):
    meta: PDMeta


class MultiFrame(msgspec.Struct, tag="multi"):
    """A ``MultiConnector``'s tuple, one meta (or None) per connector."""

    parts: list[HiCacheFrame | PDFrame | MultiFrame | None]


ConnectorMetaFrame = HiCacheFrame | PDFrame | MultiFrame


def wrap_meta(meta: Any) -> ConnectorMetaFrame | None:
    if meta is None:
        return None
    if isinstance(meta, HiCacheMeta):
        return HiCacheFrame(meta)
    if isinstance(meta, PDMeta):
        return PDFrame(meta)
    if isinstance(meta, tuple):
        return MultiFrame([wrap_meta(m) for m in meta])
    raise TypeError(f"connector metadata {type(meta).__name__} has no tensor-parallel frame (parallel/frames.py)")


def unwrap_meta(frame: ConnectorMetaFrame | None) -> Any:
    if frame is None:
        return None
    if isinstance(frame, MultiFrame):
        return tuple(unwrap_meta(p) for p in frame.parts)
    return frame.meta


# -- the frames -----------------------------------------------------------------------------------------


class CommSetup(msgspec.Struct, tag="comm_setup", frozen=True):
    """Rank 0, once the model is read and before any rank builds its shards: the shared-memory
    communicator's file when all ranks share a machine (None: gloo's collectives)."""

    shm: str | None = None
    shm_capacity: int = 0


class Setup(msgspec.Struct, tag="setup", frozen=True):
    """Rank 0, once its pool is sized: the pool's shape, which every rank builds."""

    num_tokens: int
    context: int


class ImageRows(msgspec.Struct, array_like=True):
    """A step's image rows (``multimodal.embeds.Splice``), encoded on rank 0: the flat positions they
    replace and the rows, raw in the model's dtype (bfloat16 has no numpy form)."""

    index: torch.Tensor  # int64 [n]
    dtype: Literal["float32", "float16", "bfloat16"]
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=2, max_length=2)]
    data: bytes

    @classmethod
    def of(cls, splice: Splice | None) -> ImageRows | None:
        if splice is None:
            return None
        rows = splice.rows.detach().contiguous().cpu()
        raw = rows.view(torch.uint8) if rows.numel() else rows.new_empty(0, dtype=torch.uint8)
        return cls(splice.index, str(rows.dtype).removeprefix("torch."), list(rows.shape), raw.numpy().tobytes())

    def __post_init__(self) -> None:  # (raised while decoding: a ``FrameError``)
        n, hidden = self.shape
        if n * hidden * getattr(torch, self.dtype).itemsize != len(self.data):
            raise ValueError(f"image rows of shape {self.shape} cannot be {len(self.data)} bytes of {self.dtype}")
        if self.index.shape != (n,) or self.index.dtype != torch.int64:
            raise ValueError(f"image rows' index is not {n} int64 positions")

    def splice(self) -> Splice:
        dtype = getattr(torch, self.dtype)
        n, hidden = self.shape
        rows = torch.frombuffer(bytearray(self.data), dtype=dtype) if self.data else torch.empty(0, dtype=dtype)
        return Splice(self.index, rows.reshape(n, hidden))


def _for_workers(r: ScheduledReq) -> ScheduledReq:
    """A row as the workers get it: its image feeds without their pixels (rank 0 encoded them; the
    step's ``ImageRows`` carry what every rank splices)."""
    if not r.images:
        return r
    return dataclasses.replace(r, images=[dataclasses.replace(f, item=None) for f in r.images])


class Step(msgspec.Struct, tag="step"):
    """A ``SchedulerOutput`` (every field of it: a test keeps the two equal)."""

    reqs: list[ScheduledReq]
    page_writes: list[PageWrite]
    connector_meta: ConnectorMetaFrame | None
    hisparse: SparseStep | None
    step: int
    image_drops: list[str]  # (rank 0's: the workers hold no image embeddings; carried so the frame stays whole)
    image_rows: ImageRows | None  # the step's image embeddings, encoded by rank 0

    @classmethod
    def of(cls, sched: SchedulerOutput) -> Step:
        meta = wrap_meta(sched.connector_meta)
        if any(r.images for r in sched.reqs) and sched.image_rows is None:
            raise ValueError("a step that feeds images crosses with its image rows (TPExecutor encodes them first)")
        reqs = [_for_workers(r) for r in sched.reqs]
        return cls(reqs, sched.page_writes, meta, sched.hisparse, sched.step, sched.image_drops,
                   ImageRows.of(sched.image_rows))  # fmt: skip

    def scheduler_output(self) -> SchedulerOutput:
        meta = unwrap_meta(self.connector_meta)
        rows = None if self.image_rows is None else self.image_rows.splice()
        return SchedulerOutput(self.reqs, self.page_writes, meta, self.hisparse, self.step, self.image_drops, rows)


class StatsQuery(msgspec.Struct, tag="stats_query"):
    """Instead of a step: every worker answers with its ``Stats`` (one ``gather``)."""


class Stop(msgspec.Struct, tag="stop"):
    """The group ends: workers return."""


class Stats(msgspec.Struct, tag="stats"):
    """A rank's compile counts (``CausalLM.compile_stats``)."""

    rank: int
    counts: dict[str, int]


ToWorker = Step | StatsQuery | Stop  # what a worker's loop receives


# -- the codec ------------------------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().contiguous().numpy()
    if isinstance(obj, np.ndarray):
        return Array(obj.dtype.name, list(obj.shape), np.ascontiguousarray(obj).tobytes())
    raise NotImplementedError(f"{type(obj).__name__} has no tensor-parallel wire form")


def _array(obj: Any) -> np.ndarray:
    a = msgspec.convert(obj, Array)
    dtype = np.dtype(a.dtype)
    if math.prod(a.shape) * dtype.itemsize != len(a.data):
        raise ValueError(f"an array of shape {a.shape} and dtype {a.dtype} cannot hold {len(a.data)} bytes")
    return np.frombuffer(a.data, dtype=dtype).reshape(a.shape).copy()


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        return _array(obj)
    if kind is torch.Tensor:
        return torch.from_numpy(_array(obj))
    raise NotImplementedError(f"{kind} has no tensor-parallel wire form")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


@functools.cache
def _decoder(kind: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)


def encode(obj: Any) -> bytearray:
    buf = bytearray()
    _encoder.encode_into(obj, buf)
    return buf


def decode(data: bytes | bytearray | memoryview, kind: Any) -> Any:
    """``data`` as exactly ``kind``, or ``FrameError``: nothing in a frame is ever run, only typed data
    is built from it."""
    try:
        return _decoder(kind).decode(data)
    except msgspec.DecodeError as e:  # ValidationError (a frame of another type) included
        raise FrameError(f"a tensor-parallel frame that is not a {_name(kind)}: {e}") from None


def _name(kind: Any) -> str:
    parts = get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    return " | ".join(k.__name__ if isinstance(k, type) else str(k) for k in parts)


def _check_size(n: int) -> int:
    if not 0 < n <= MAX_FRAME_BYTES:
        raise FrameError(f"a tensor-parallel frame of {n} bytes (at most {MAX_FRAME_BYTES})")
    return n


# -- over the group ---------------------------------------------------------------------------------------


def broadcast(frame: Any, kind: Any) -> Any:
    """Rank 0: send ``frame`` to every rank and return it. Another rank: rank 0's frame, as ``kind``."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        data = encode(frame)
        dist.broadcast(torch.tensor([_check_size(len(data))], dtype=torch.int64), src=0)
        dist.broadcast(torch.frombuffer(data, dtype=torch.uint8), src=0)
        return frame
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    buf = torch.empty(_check_size(int(size)), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return decode(buf.numpy(), kind)


def gather(obj: Any, kind: Any) -> list | None:
    """Every rank's ``obj`` (each a ``kind``), in rank order, on rank 0 (None on the others); rank 0's
    own is its object, the others' are decoded."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = encode(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    sizes = [_check_size(int(s)) for s in sizes]
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(data, dtype=torch.uint8)
    if rank != 0:
        dist.gather(mine, dst=0)
        return None
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.gather(mine, parts, dst=0)
    return [obj, *(decode(parts[r][: sizes[r]].numpy(), kind) for r in range(1, world))]


def gather_tier_reports(report: TierReport) -> list[TierReport] | None:
    """The hierarchical cache's gather (``hicache/connector.py``'s ``Gather``)."""
    return gather(report, TierReport)
