"""The collectives: those the forward calls, and the raw tensor ones PD's KV heads move by under
tensor parallelism (``gather_tensors`` / ``scatter_tensors``, ``disagg/tp.py``). Below the model and
the engine (the ranks' processes, ``parallel/``, sit above them), it imports nothing of the project.

The forward's collectives. ``Comm`` (one rank) does nothing; ``TPComm`` wraps a
torch.distributed group (gloo on CPUs, NCCL on GPUs); ``ShmComm`` does them through shared memory.

Inside a ``torch.compile`` graph a collective is a custom op (``kvledger::all_reduce``,
``kvledger::gather_vocab``), opaque to the compiler as attention is: dynamo cannot trace a wait on
another process's flag (the shared-memory loop graph-broke the forward into 19 graphs), and the op
keeps the graph one graph on every rank. The op finds its communicator by handle (the compiled
forward cannot take a Python object)."""

from __future__ import annotations

import itertools
import os
import time
import weakref

import torch

from .common.cpus import default_threads


class TPGroupBroken(RuntimeError):
    """A rank died or a collective failed: the group cannot go on (the engine restarts). Here, with
    the collectives, so the engine core catches it without importing the ranks' processes."""


def rank_threads(cfg) -> int | None:
    """Compute threads for one rank: the flag if given; with several ranks on this machine, the cores
    this process may run on (its affinity) shared out between them (oversubscribed ranks wait on each
    other in every collective); None: all of them (``common.cpus.default_threads``)."""
    if cfg.parallel.num_threads:
        return cfg.parallel.num_threads
    local = cfg.parallel.tp_size // cfg.parallel.nnodes
    return max(1, default_threads() // local) if local > 1 else None


class Comm:
    """A single rank: identity collectives."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        return x


# Live communicators by handle, for the custom ops below (weak: an engine's ends with it).
_COMMS: weakref.WeakValueDictionary[int, TPComm] = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


class TPComm(Comm):
    """Collectives over the torch.distributed group. ``all_reduce`` and ``gather_vocab`` are what the
    forward calls; subclasses implement ``_all_reduce`` and ``_gather_vocab``."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.handle = next(_next_handle)
        _COMMS[self.handle] = self

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (``x`` may be summed in place; use the result)."""
        if torch.compiler.is_compiling():
            return _all_reduce_op(x, self.handle)
        return self._all_reduce(x)

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's logits for its slice of the vocabulary -> the whole vocabulary, on every rank."""
        if torch.compiler.is_compiling():
            return _gather_vocab_op(x, self.handle, self.size)
        return self._gather_vocab(x)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def _gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


@torch.library.custom_op("kvledger::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, handle: int) -> torch.Tensor:
    """``TPComm.all_reduce`` inside compiled graphs (on a copy: a custom op returns a new tensor)."""
    return _COMMS[handle]._all_reduce(x.clone())


@_all_reduce_op.register_fake
def _(x, handle):
    return torch.empty_like(x)


@torch.library.custom_op("kvledger::gather_vocab", mutates_args=())
def _gather_vocab_op(x: torch.Tensor, handle: int, size: int) -> torch.Tensor:
    """``TPComm.gather_vocab`` inside compiled graphs."""
    return _COMMS[handle]._gather_vocab(x)


@_gather_vocab_op.register_fake
def _(x, handle, size):
    return x.new_empty(*x.shape[:-1], x.shape[-1] * size)


class ShmComm(TPComm):
    """All-reduce and all-gather through shared memory between the ranks of one machine: each rank
    writes its part into its own slot and raises its sequence flag; every rank waits for all flags
    and sums the slots in rank order (so every rank gets bit-identical results). Two buffer sets by
    step parity make one wait per collective enough: a rank can only reuse a set once every other
    rank has announced the next step, i.e. finished reading this one. gloo over loopback costs ~2 ms
    per all-reduce here (bench/tensor_parallel.py), which this replaces; tensors larger than the slot
    fall back to gloo (all ranks see the same shapes, so all take the same path)."""

    FLAG_STRIDE = 8  # int64s between flags: one cache line each

    def __init__(self, rank: int, size: int, path: str, capacity: int, create: bool, peers_alive=None):
        super().__init__(rank, size)
        self.capacity = capacity
        header = size * self.FLAG_STRIDE * 8
        nbytes = header + 2 * size * capacity * 4
        if create:
            # This user's alone (the slots hold every request's hidden states), and a fresh file: an
            # existing one (or a link planted at the name) is an error, never written through.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self.path = path
        self.flags = raw[:header].view(torch.int64)
        self.data = raw[header:].view(torch.float32).view(2, size, capacity)
        self.step = 0
        self.peers_alive = peers_alive  # rank 0: a check that its worker processes still run
        self._yield = os.sched_yield

    def _publish(self, x: torch.Tensor) -> torch.Tensor | None:
        """Write ``x`` into this rank's slot and wait for everyone's; None if it does not fit."""
        n = x.numel()
        if n > self.capacity:
            return None
        self.step += 1
        parity = self.step % 2
        self.data[parity, self.rank, :n].copy_(x.reshape(-1))
        self.flags[self.rank * self.FLAG_STRIDE] = self.step
        deadline = time.monotonic() + 0.5
        for j in range(self.size):
            while int(self.flags[j * self.FLAG_STRIDE]) < self.step:
                self._yield()
                if self.peers_alive is not None and time.monotonic() > deadline:
                    if not self.peers_alive():
                        raise TPGroupBroken("a tensor-parallel rank died during a collective")
                    deadline = time.monotonic() + 0.5
        return self.data[parity, :, :n]

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._publish(x)
        if parts is None:
            return super()._all_reduce(x)
        total = parts[0].clone()
        for j in range(1, self.size):
            total += parts[j]
        x.copy_(total.view(x.shape))
        return x

    def _gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._publish(x)
        if parts is None:
            return super()._gather_vocab(x)
        return torch.cat([parts[j].view(x.shape).to(x.dtype) for j in range(self.size)], dim=-1)


def _wire(t):
    """``t`` as gloo can send it: gloo knows no float8, so a float8 KV pool's pages cross as their
    bytes (a view of the same memory, no copy)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather_tensors(t):
    """Every rank's ``t`` (the same shape and dtype on all), in rank order, on rank 0 (None
    elsewhere): raw tensors over gloo, no pickling (PD's heads, ``disagg/tp.py``)."""
    import torch.distributed as dist

    t = t.contiguous()
    if dist.get_rank() != 0:
        dist.gather(_wire(t), dst=0)
        return None
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.gather(_wire(t), [_wire(o) for o in out], dst=0)
    return out


def scatter_tensors(parts, out) -> None:
    """Rank 0's ``parts[r]`` into rank ``r``'s ``out`` (``parts`` None on the other ranks)."""
    import torch.distributed as dist

    dist.scatter(_wire(out), None if parts is None else [_wire(p) for p in parts], src=0)
