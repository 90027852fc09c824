"""CUDA graphs for decode steps (SGLang's ``CudaGraphRunner``, kvledger's shape).

A step whose requests each bring exactly one token and sample it (no prefill chunk, draft, prompt
logprobs, pooling, LoRA adapter or HiSparse row), at most ``max_bs`` of them, is padded up to the
next captured batch size (``capture_sizes``: 1, 2, 4, 8, 16, 24, 32, then every 16 up to
``--cuda-graph-max-bs``) and replays that size's graph. Every other step runs eager, counted by
reason (``eager_steps``). Sampling runs after the replay, outside the graph (on the device with the
device sampler), so grammar masks and penalties never force a step eager.

Static inputs: one int64 block ``[4, max_bs]`` (token ids, positions, page-table rows, sequence
lengths). The host writes a step's values into a (pinned) mirror and sends them in one copy; all
else is derived inside the graph (each row's KV location ``req_to_token[row, position]``; the
logits of every row). Padding rows feed token 0 at position 0 of the page table's padding row
(``PageTable.add_pad_row``), every location of which is on the runner's reserved page
(``KVManager.reserve``, owner ``PAD_OWNER`` in the books): they write their K/V there, attend to it,
and their logits are dropped. No padding row touches a request's KV.

Capture and replay sit behind ``GraphCapture`` (``graph_capture.py``): ``CudaGraphCapture``
(``torch.cuda.CUDAGraph``, one memory pool for every size, the largest captured first) on CUDA;
``EagerCapture`` in the CPU tests: a replay calls the step function again on the same static buffers,
and checks that it runs the same ops on the same shapes as at capture and reads no tensor's value on
the host, which a graph could not.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter

import numpy as np
import torch

from ..kernels import triton_decode
from ..memory import KVBuffer
from ..model import ForwardBatch, LlamaModel
from ..model.attention_context import attention_context
from ..model.attention_graph import GraphDecodeAttention, GraphDecodeMeta
from ..scheduler.output import SchedulerOutput
from .graph_capture import CapturedStep, CudaGraphCapture, GraphCapture
from .page_table import PageTable

log = logging.getLogger(__name__)

DEFAULT_MAX_BS = 160  # SGLang's --cuda-graph-max-bs default (GPUs of 25 GB and more)
PAD_OWNER = "cuda graph padding (engine/graph_runner.py)"

# Why a step ran eager (the keys of ``eager_steps``).
PREFILL = "prefill"  # a request brings several tokens or samples none (a chunk, prompt logprobs, pooling)
SPECULATIVE = "speculative"  # a request verifies drafts
LORA = "lora"
HISPARSE = "hisparse"
KV_CONNECTOR = "kv_connector"  # the connector's worker side runs per layer (hierarchical cache, PD)
SLIDING_WINDOW = "sliding_window"  # some sequence is longer than a layer's window
BATCH_SIZE = "batch_size"  # more requests than the largest captured size
MROPE = "mrope"  # a row's rope positions are offset by its images (M-RoPE): the graphs take the index


def capture_sizes(max_bs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, 16, 24, 32, then every 16, up to ``max_bs`` (included)."""
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32) if s <= max_bs] + list(range(48, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def graph_max_bs(cuda_graph_max_bs: int | None, max_running_requests: int) -> int:
    return min(cuda_graph_max_bs or DEFAULT_MAX_BS, max_running_requests)


def unsupported(model: LlamaModel) -> str | None:
    """Why ``model``'s decode step cannot be captured (None: it can)."""
    if not model.net.graph_safe:
        return f"{model.cfg.arch}'s routed experts size their matmuls on the host"
    if model.net.comm.size > 1:
        return "tensor parallel"
    if model.attn.softcap is not None:
        return "soft-capped attention scores"
    if any(s is not None for s in getattr(model.attn, "sinks", ())):
        return "attention sinks"
    if model.device.type == "cuda" and triton_decode.available() is not None:
        return triton_decode.available()
    return None


class DecodeGraphRunner:
    """Captured decode steps of one model over one KV pool and page table (see the module's doc)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_buffer: KVBuffer,
        page_table: PageTable,
        pad_page: int,
        max_bs: int,
        capture: GraphCapture,
    ):
        self.kv_buffer = kv_buffer
        self.page_table = page_table
        self.capture_backend = capture
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.pad_page = pad_page
        self.pad_row = page_table.add_pad_row(pad_page)
        dev = page_table.req_to_token.device
        # ids, positions, rows, lengths; the device block and its host mirror (one copy a step).
        self.static = torch.zeros(4, self.max_bs, dtype=torch.int64, device=dev)
        self.host = torch.zeros(4, self.max_bs, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._host_np = self.host.numpy()
        self._pad = np.array([0, 0, self.pad_row, 1], dtype=np.int64)[:, None]  # a padding row's column
        self.logit_rows = torch.arange(self.max_bs, device=dev)
        self.replays = 0
        self.eager_steps: Counter[str] = Counter()
        self.capture_s = 0.0
        self.set_model(model)

    # -- capture ---------------------------------------------------------------------------------------
    def set_model(self, model: LlamaModel) -> None:
        """Capture every size for ``model`` (at start, and after a weight update replaced the model)."""
        self.model = model
        self.windows = [w for w in model.attn.windows if w is not None]
        self.attn = GraphDecodeAttention(
            model.cfg.num_heads, model.cfg.num_kv_heads, model.cfg.head_dim, model.attn.scale,
            "triton" if model.device.type == "cuda" else "torch",
        )  # fmt: skip
        self.graphs: dict[int, CapturedStep] = {}
        t0 = time.perf_counter()
        # Captured on padding rows only: the warm-up forwards write nowhere but the reserved page.
        self._host_np[:] = self._pad
        self.static.copy_(self.host)
        for bs in reversed(self.sizes):  # the largest first: the smaller ones reuse its pool
            self.graphs[bs] = self.capture_backend.capture(functools.partial(self._step, bs))
        self.capture_s = time.perf_counter() - t0
        log.info("decode graphs (%s) captured for batch sizes %s in %.1fs", self.capture_backend.name,
                 ",".join(map(str, self.sizes)), self.capture_s)  # fmt: skip

    def _step(self, bs: int) -> torch.Tensor:
        """The captured function: one decode forward of ``bs`` rows from the static block."""
        ids, pos, rows, lens = self.static[:, :bs].unbind(0)
        table = self.page_table.req_to_token
        batch = ForwardBatch(
            input_ids=ids, positions=pos, out_loc=table[rows, pos], req_rows=[], prefix_lens=[], extend_lens=[],
            seq_lens=[], logit_index=self.logit_rows[:bs], req_to_token=table, page_size=self.page_table.page_size,
            attn_meta=GraphDecodeMeta(rows, lens),
        )  # fmt: skip
        model = self.model
        with torch.inference_mode(), attention_context(model.handle, self.attn, self.kv_buffer, batch):
            return model.net(ids, pos, batch.logit_index)

    # -- a step ----------------------------------------------------------------------------------------
    def eager_reason(self, sched: SchedulerOutput, connector=None) -> str | None:
        """Why this step cannot replay a graph (None: it can)."""
        if connector is not None:
            return KV_CONNECTOR
        for r in sched.reqs:
            if r.num_draft:
                return SPECULATIVE
            if r.num_tokens != 1 or r.sampling is None or r.prompt_lp_targets or r.label_token_ids or r.pool_from >= 0:
                return PREFILL
            if r.lora is not None:
                return LORA
            if r.rope_delta:
                return MROPE
        if sched.hisparse is not None and sched.hisparse.rows:
            return HISPARSE
        if len(sched.reqs) > self.max_bs:
            return BATCH_SIZE
        if self.windows and max(r.start + 1 for r in sched.reqs) > min(self.windows):
            return SLIDING_WINDOW
        return None

    def try_run(self, sched: SchedulerOutput, connector=None) -> torch.Tensor | None:
        """The logits ``[len(sched.reqs), vocab]`` of a step that replays a graph (a view of the
        graph's output, valid until the next replay), or None: the caller runs it eager (counted)."""
        reason = self.eager_reason(sched, connector)
        if reason is not None:
            self.eager_steps[reason] += 1
            return None
        return self.run(sched)

    def run(self, sched: SchedulerOutput) -> torch.Tensor:
        n = len(sched.reqs)
        bs = self.sizes[int(np.searchsorted(self.sizes, n))]
        h = self._host_np
        h[0, :n] = [r.token_ids[0] for r in sched.reqs]
        h[1, :n] = [r.start for r in sched.reqs]
        h[2, :n] = [r.slot for r in sched.reqs]
        h[3, :n] = h[1, :n] + 1
        h[:, n:bs] = self._pad
        # One transfer of the whole block (contiguous; the columns past bs are not read). The pinned
        # mirror is rewritten only by the next step, after this step's sampled ids came back to the
        # host (which waited for this copy).
        self.static.copy_(self.host, non_blocking=True)
        out = self.graphs[bs].replay()
        self.replays += 1
        return out[:n]

    def stats(self) -> dict:
        """``/metrics`` and the GPU check: sizes, replays, eager steps by reason, capture time."""
        return {
            "capture": self.capture_backend.name,
            "batch_sizes": list(self.sizes),
            "replays": self.replays,
            "eager_steps": dict(self.eager_steps),
            "capture_s": round(self.capture_s, 3),
        }


def graphs_wanted(disable_cuda_graph: bool, device: str, capture: GraphCapture | None) -> bool:
    """Graphs on CUDA unless ``--disable-cuda-graph``; elsewhere only with an explicit ``capture``
    (the tests' ``EagerCapture``)."""
    if capture is not None:
        return True
    return torch.device(device).type == "cuda" and not disable_cuda_graph


def graphs_planned(
    disable_cuda_graph: bool, device: str, capture: GraphCapture | None, model: LlamaModel, num_pages: int
) -> bool:
    """Whether the engine captures decode steps (decided before the pool's books are made: the
    padding page is one fewer for requests). A model whose step cannot be captured says why in the log."""
    if not graphs_wanted(disable_cuda_graph, device, capture):
        return False
    why = unsupported(model) or ("the KV pool has a single page" if num_pages < 2 else None)
    if why is not None:
        log.warning("CUDA graphs off: %s (every step runs eager)", why)
        return False
    return True


def make_graph_runner(
    model: LlamaModel,
    kv_buffer: KVBuffer,
    page_table: PageTable,
    kv_manager,
    max_bs: int,
    capture: GraphCapture | None,
) -> DecodeGraphRunner:
    """The runner for ``model``, its padding page reserved in ``kv_manager``'s books (``graphs_planned``
    said yes)."""
    page = kv_manager.reserve(PAD_OWNER)[0]
    capture = capture or CudaGraphCapture(model.device)
    return DecodeGraphRunner(model, kv_buffer, page_table, page, max_bs, capture)
