"""What crosses the executor seam: the scheduler's ``SchedulerOutput`` out to the executor, the
``ModelRunnerOutput`` back. Plain data only (ids, lists and numpy bitmasks; no tensors, no ``Req``), so
that a group of tensor-parallel workers in other processes can receive the same objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..common.outputs import TopLogprobs
from ..common.sampling import SamplingRow
from ..memory import PageWrite


@dataclass(slots=True)
class ImageFeed:
    """An image's share of a chunk (``multimodal/``): its embeddings' rows ``[first, first + count)``
    replace the chunk's tokens ``[at, at + count)``. ``item`` is set when the runner holds no
    embeddings under ``key`` and must encode the image (unless the encoder cache has them); ``last``: the chunk holds the image's last
    token, after which the runner drops them."""

    key: str
    at: int
    first: int
    count: int
    item: Any = None  # multimodal.ImageItem
    last: bool = False
    # The encoder cache (``scheduler/images.py``): where the runner may find the image's embeddings
    # (read before encoding ``item``), and whether it keeps them there once encoded.
    cache_key: str | None = None
    store: bool = False


@dataclass(slots=True)
class ScheduledReq:
    """One request's share of a step: ``token_ids`` fed at positions ``start..``; the last
    ``num_draft`` of them are speculative drafts past the sequence's end. With ``sampling`` set the
    chunk reaches the end, and ``1 + num_draft`` tokens are sampled (one per verified position)."""

    rid: str
    slot: int
    start: int
    token_ids: list[int]
    num_draft: int = 0
    sampling: SamplingRow | None = None
    # Structured outputs: int32 [1 + num_draft, ceil(V / 32)], one row per sampled position.
    token_bitmask: np.ndarray | None = None
    # Prompt logprobs: the logprob of each of these prompt tokens, from the rows starting at chunk
    # offset ``prompt_lp_offset`` (row j predicts target j).
    prompt_lp_targets: list[int] | None = None
    prompt_lp_offset: int = 0
    prompt_lp_top: int = 0  # top logprobs per prompt position
    # Pooling (common/pooling.py): the final-norm hidden states of rows ``pool_from..`` of this chunk
    # come back summed (-1: none); the logprobs of ``label_token_ids`` at the chunk's last row.
    pool_from: int = -1
    label_token_ids: list[int] | None = None
    lora: str | None = None  # the LoRA adapter this request's rows run with (None: the base model)
    # Overlap scheduling (``scheduler/overlap.py``): the id under which the executor keeps this row's
    # sampled token for the next step, whose ``token_ids`` (and penalty history) may name it by a
    # placeholder ``-1 - future`` (-1: the row is not overlapped).
    future: int = -1
    images: list[ImageFeed] | None = None  # the images whose tokens this chunk feeds
    # M-RoPE (``multimodal/mrope.py``): the offset added to the rows' positions (the request's
    # images before them), or, for a chunk that meets an image, each token's three positions
    # (int64 ``[3, num_tokens]``); 0 and None for every other model's rows.
    rope_delta: int = 0
    mrope: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    reqs: list[ScheduledReq] = field(default_factory=list)
    page_writes: list[PageWrite] = field(default_factory=list)  # page-table changes, applied first
    connector_meta: Any = None  # from KVConnector.build_connector_meta, for its worker side
    hisparse: Any = None  # memory/sparse_kv.py SparseStep: HiSparse's copies and sparse rows (or None)
    step: int = 0  # the scheduler's number for this step (overlap: which launched step a result is)
    # Image embeddings the runner holds that no later chunk will read (their requests ended or were
    # retracted): dropped before this step runs (``scheduler/images.py``).
    image_drops: list[str] = field(default_factory=list)
    # The step's image rows already encoded (``multimodal.embeds.Splice``): with tensor parallel, rank 0
    # encodes every image of the step (its drops applied first) before it broadcasts the step, and every
    # rank splices these rows; None: the runner encodes (one rank), or the step feeds no image.
    image_rows: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.reqs)

    def subset(self, i: int) -> SchedulerOutput:
        """Request ``i`` alone (fault isolation reruns a failed step request by request)."""
        r = self.reqs[i]
        sparse = self.hisparse
        if sparse is not None:
            # Only this request's first sparse step: rerunning another slot's ``begin`` after that
            # request's own rerun would reset its state and lose the token its forward backed up.
            sparse = type(sparse)(sparse.ends, [b for b in sparse.begins if b.slot == r.slot],
                                  [s for s in sparse.rows if s == r.slot])  # fmt: skip
        return SchedulerOutput([r], self.page_writes, self.connector_meta, sparse, self.step, self.image_drops)


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, in order: the tokens it received (0..k), their logprobs, and whether
    its forward failed (``errors[i]`` set: nothing was computed for it)."""

    tokens: list[list[int]]
    logprobs: list[list[float | None]]
    top_logprobs: list[list[TopLogprobs | None]]
    errors: list[str | None] | None = None
    prompt_logprobs: list[list[float]] | None = None  # per request, for its prompt_lp_targets
    prompt_top_logprobs: list[list[TopLogprobs | None]] | None = None
    pooled: list[np.ndarray | None] | None = None  # per request: the sum of its pooled rows (float64)
    label_logprobs: list[list[float] | None] | None = None  # per request: for its label_token_ids
    finished_sending: set[str] = field(default_factory=set)  # connector: async saves done
    finished_recving: set[str] = field(default_factory=set)  # connector: KV loads done

    @classmethod
    def empty(cls, n: int) -> ModelRunnerOutput:
        return cls([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])
