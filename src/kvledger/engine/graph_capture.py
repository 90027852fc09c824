"""How a decode step is captured and replayed, behind one protocol (``GraphCapture``).

``CudaGraphCapture``: ``torch.cuda.CUDAGraph``s sharing one memory pool (the largest size captured
first), on a side stream after two warm-up runs. ``EagerCapture``: the CPU tests' stand-in; a replay
calls the step function again on the same static buffers, and checks that it runs the same ops on the
same shapes as at capture and reads no tensor's value on the host, which a graph could not
(``GraphCaptureError`` otherwise). The runner that uses them is ``graph_runner.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class CapturedStep(Protocol):
    def replay(self) -> torch.Tensor:
        """Run the captured step on the static buffers as they are now; its output tensor (the same
        storage at every replay)."""


class GraphCapture(Protocol):
    name: str

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        """Capture ``fn`` (which reads only the runner's static buffers and the model's tensors)."""


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph``s sharing one memory pool, captured on a side stream after two warm-up
    runs (Triton compiles its kernel, cuBLAS picks its own, outside the capture)."""

    name = "cuda"

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pool = None
        self.stream: torch.cuda.Stream | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        s = self.stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=s):
            out = fn()
        self.pool = graph.pool()
        return _CudaStep(graph, out)


class _CudaStep:
    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor):
        self.graph, self.out = graph, out

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class GraphCaptureError(RuntimeError):
    """The step function does something a CUDA graph cannot hold (``EagerCapture``'s checks)."""


# Ops whose result a graph could not hold: a value read on the host, or a shape that depends on data.
_HOST_READS = frozenset(
    {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_dim"}
)


class _OpLog(TorchDispatchMode):
    """Every aten op a function runs, with the shapes and dtypes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        # Indexing with a boolean mask has as many rows as the mask has True values (CUDA finds them
        # with nonzero, a sync).
        masked = name.startswith("aten.index") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_leaves(args[1:2])
        )
        if name in _HOST_READS or masked:
            raise GraphCaptureError(f"the captured step calls {name}{' with a boolean mask' if masked else ''}: "
                                    "a value read on the host or a data-dependent shape, which a CUDA graph "
                                    "cannot replay")  # fmt: skip
        shapes = tuple(
            (tuple(t.shape), t.dtype) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        )
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def _logged(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    mode = _OpLog()
    with mode:
        out = fn()
    return out, mode.ops


class EagerCapture:
    """The CPU stand-in: a "replay" runs the captured function again (on the static buffers, as a
    graph would read them). With ``check`` (the default) every replay must run the ops of the capture
    on the same shapes, and no op may read a value on the host (``GraphCaptureError`` otherwise): a
    step that passes here has the fixed shape a CUDA graph needs."""

    name = "eager"

    def __init__(self, check: bool = True):
        self.check = check
        self.captured = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedStep:
        self.captured += 1
        ops = _logged(fn)[1] if self.check else None
        return _EagerStep(fn, ops)


class _EagerStep:
    def __init__(self, fn: Callable[[], torch.Tensor], ops: list[tuple] | None):
        self.fn, self.ops = fn, ops

    def replay(self) -> torch.Tensor:
        if self.ops is None:
            return self.fn()
        out, ops = _logged(self.fn)
        if ops != self.ops:
            i = next((i for i, (a, b) in enumerate(zip(ops, self.ops)) if a != b), min(len(ops), len(self.ops)))
            raise GraphCaptureError(
                f"the replay ran other ops than the capture (op {i}: {ops[i] if i < len(ops) else 'none'} "
                f"vs {self.ops[i] if i < len(self.ops) else 'none'}): the step is not fixed-shape"
            )
        return out
