"""Model runner: a ``SchedulerOutput`` in, a ``ModelRunnerOutput`` out. Applies the page-table
changes, builds the ``ForwardBatch``, runs the model, samples, and verifies drafts."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..common.sampling import SamplingRow
from ..kernels.governor import ThreadGovernor
from ..memory import KVBuffer
from ..model import DeviceSampler, ForwardBatch, LlamaModel, Sampler
from ..model import lora as lora_mod
from ..model.sampler import GREEDY_EPS
from ..multimodal.embeds import ImageEmbeds
from ..multimodal.encoder import VisionEncoder
from ..scheduler.output import ModelRunnerOutput, ScheduledReq, SchedulerOutput
from .page_table import PageTable

if TYPE_CHECKING:
    from .graph_runner import DecodeGraphRunner


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_buffer: KVBuffer,
        page_table: PageTable,
        seed: int = 0,
        sampling: str = "host",
        sparse=None,
        graphs: Callable[[], DecodeGraphRunner] | None = None,
        encoder: VisionEncoder | None = None,
    ):
        """``sampling``: ``host`` (a CPU copy of the sampled rows' logits, ``model/sampler.py``) or
        ``device`` (batched on the logits' device, one copy of the ids back, ``model/sampler_device.py``).
        ``sparse``: HiSparse's ``SparseWorker`` (``model/hisparse.py``), with --enable-hisparse.
        ``graphs``: captures the decode steps' CUDA graphs (``engine/graph_runner.make_graph_runner``),
        called here once the model's attention knows the pool's KV dtype, which the capture writes.
        ``encoder``: a vision-language model's vision tower and projector (``multimodal/``)."""
        self.model = model
        self.kv_buffer = kv_buffer
        model.attn.kv_dtype = kv_buffer.k.dtype  # what the backend writes and reads (float8: --kv-cache-dtype)
        self.page_table = page_table
        self.on_device = sampling == "device"
        det = getattr(model, "deterministic", False)  # unseeded rows seeded under deterministic inference
        self.sampler = DeviceSampler(seed, det) if self.on_device else Sampler(seed, det)
        self.sparse = sparse
        self.images = ImageEmbeds(encoder) if encoder is not None else None  # embeddings between chunks
        # engine/graph_runner.py DecodeGraphRunner: decode steps replay CUDA graphs (None: all eager).
        self.graphs: DecodeGraphRunner | None = graphs() if graphs is not None else None
        # On a CPU, fewer torch threads while another process holds one of this process's cores
        # (kernels/governor.py; the kernels' own pool governs itself, csrc/pool.h).
        cpu = kv_buffer.k.device.type == "cpu" and os.environ.get("KVLEDGER_THREAD_GOVERNOR", "1") != "0"
        self.threads = ThreadGovernor(torch.get_num_threads()) if cpu else None

    def build(self, sched: SchedulerOutput) -> ForwardBatch:
        """Flatten the scheduled requests; every request that samples puts ``1 + num_draft``
        positions through the LM head (its last sequence token and each draft)."""
        table = self.page_table.req_to_token
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        out_loc: list[torch.Tensor] = []
        logit_index: list[int] = []
        pool_index: list[int] = []
        rows, prefix, ext, seq = [], [], [], []
        starts: list[int] = []
        t = 0
        for r in sched.reqs:
            a, n = r.start, r.num_tokens
            starts.append(t)
            ids.extend(r.token_ids)
            # (M-RoPE: a text row's positions are offset by its images'; an image chunk's are three rows)
            positions.append(torch.arange(a + r.rope_delta, a + r.rope_delta + n) if r.mrope is None
                             else torch.from_numpy(r.mrope[0]))  # fmt: skip
            out_loc.append(table[r.slot, a : a + n])
            rows.append(r.slot)
            prefix.append(a)
            ext.append(n)
            seq.append(a + n)
            t += n
            if r.prompt_lp_targets:
                first = t - n + r.prompt_lp_offset
                logit_index.extend(range(first, first + len(r.prompt_lp_targets)))
            if r.label_token_ids:
                logit_index.append(t - 1 - r.num_draft)
            if r.pool_from >= 0:
                pool_index.extend(range(t - n + r.pool_from, t - r.num_draft))
            if r.sampling is not None:
                logit_index.extend(range(t - 1 - r.num_draft, t))
        splice = sched.image_rows  # encoded before the step crossed to the other ranks (TP), or:
        if splice is None and any(r.images for r in sched.reqs):
            if self.images is None:
                raise RuntimeError("a step feeds image tokens to a model without a vision encoder")
            splice = self.images.splice(sched.reqs, starts)
        mrope = None
        if any(r.mrope is not None for r in sched.reqs):
            mrope = torch.cat([
                torch.from_numpy(r.mrope) if r.mrope is not None else p.expand(3, -1)
                for r, p in zip(sched.reqs, positions)
            ], dim=1)  # fmt: skip
        return ForwardBatch(
            mrope_positions=mrope,
            mm_index=None if splice is None else splice.index,
            mm_rows=None if splice is None else splice.rows,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(positions),
            out_loc=torch.cat(out_loc),
            req_rows=rows,
            prefix_lens=prefix,
            extend_lens=ext,
            seq_lens=seq,
            logit_index=torch.tensor(logit_index, dtype=torch.int64),
            req_to_token=table,
            page_size=self.page_table.page_size,
            sparse_worker=self.sparse,
            sparse_rows=frozenset(sched.hisparse.rows) if sched.hisparse is not None else frozenset(),
            pool_index=torch.tensor(pool_index, dtype=torch.int64) if pool_index else None,
            lora=lora_mod.LoraBatch.of([r.lora for r in sched.reqs], ext, table.device),
        ).to(table.device)

    def encode_images(self, sched: SchedulerOutput) -> None:
        """Tensor parallel, rank 0, before the step is broadcast: apply the step's image drops, encode
        every image it feeds and keep the rows in ``sched.image_rows``, so that every rank splices the
        same rows (the workers hold no encoder, no embeddings and no encoder cache: rank 0's books
        describe everything there is)."""
        if self.images is None or sched.image_rows is not None:
            return
        if sched.image_drops:
            self.images.drop(sched.image_drops)
        if any(r.images for r in sched.reqs):
            starts = np.cumsum([0] + [r.num_tokens for r in sched.reqs[:-1]]).tolist()
            sched.image_rows = self.images.splice(sched.reqs, starts)

    def execute(
        self, sched: SchedulerOutput, connector=None, sample: bool = True
    ) -> ModelRunnerOutput | None:
        """One step; a tensor-parallel worker rank runs the forward only (``sample=False``): rank 0
        samples from the same gathered logits."""
        self.page_table.apply(sched.page_writes)
        # (With ``image_rows`` set, ``encode_images`` applied the drops before it encoded.)
        if self.images is not None and sched.image_drops and sched.image_rows is None:
            self.images.drop(sched.image_drops)
        if sched.hisparse is not None:
            self.sparse.apply(sched.hisparse, self.kv_buffer)  # copies to host before the forward
        if not sched.reqs:  # only page-table changes (pages for KV a connector is loading)
            if connector is not None:
                # Loads that come with no forward (PD decode with tiers: a tier's part of the prompt,
                # the rest arriving by transfer) are copied now, layer by layer as in a forward.
                for layer in range(self.kv_buffer.k.shape[0]):
                    connector.wait_for_layer_load(layer)
            return ModelRunnerOutput.empty(0) if sample else None
        # Not under torch.compile: its graphs guard on torch's thread count (a change recompiles the
        # forward, seconds of compilation each time a core comes or goes).
        if self.threads is not None and getattr(self.model, "compiled", None) is None:
            self.threads.tick()
        if self.graphs is not None and sched.image_rows is None and not any(r.images for r in sched.reqs):
            logits = self.graphs.try_run(sched, connector)  # None: this step runs eager (counted)
            if logits is not None:
                return self._sample(sched, logits) if sample else None
        batch = self.build(sched)
        hidden = None
        with lora_mod.active(batch.lora):  # each row's adapter, for the adapted projections
            if sample and batch.pool_index is None and self._greedy_only(sched, batch):
                tokens = self.model.forward(batch, self.kv_buffer, connector, greedy=True).tolist()
                return self._greedy_out(sched, tokens)
            if batch.pool_index is None:
                logits = self.model.forward(batch, self.kv_buffer, connector)
            else:
                logits, hidden = self.model.forward_pooled(batch, self.kv_buffer, connector)
        return self._sample(sched, logits, hidden) if sample else None

    def _greedy_only(self, sched: SchedulerOutput, batch: ForwardBatch) -> bool:
        """Whether this step's sampled rows need only their greedy tokens: every request greedy, with no
        logprobs, penalties, grammar, drafts, prompt logprobs, labels or pooling, sampled on the host,
        and the model's head can give them in C++ (``CausalLM.greedy_head``). Then the head runs as an
        argmax over chunks of the vocabulary (a 262,144-token head's logits never written out)."""
        if self.on_device or not batch.logit_index.numel():
            return False
        for r in sched.reqs:
            if r.num_draft or r.token_bitmask is not None or r.prompt_lp_targets or r.label_token_ids:
                return False
            p = r.sampling.params if r.sampling is not None else None
            if p is not None and (p.temperature >= GREEDY_EPS or p.wants_logprobs or p.has_penalties):
                return False
        return self.model.greedy_head(int(batch.logit_index.numel()))

    @staticmethod
    def _greedy_out(sched: SchedulerOutput, tokens: list[int]) -> ModelRunnerOutput:
        """What ``_sample`` gives for greedy rows without logprobs: one token each, in row order."""
        out = ModelRunnerOutput.empty(len(sched.reqs))
        k = 0
        for i, r in enumerate(sched.reqs):
            if r.sampling is None:
                continue
            out.tokens[i], out.logprobs[i], out.top_logprobs[i] = [tokens[k]], [None], [None]
            k += 1
        return out

    def _sample(
        self, sched: SchedulerOutput, logits: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> ModelRunnerOutput:
        out = ModelRunnerOutput.empty(len(sched.reqs))
        if hidden is not None:
            self._pooled(sched, hidden, out)
        # Host sampling: one copy of the sampled rows' logits per step. Device sampling keeps them
        # where they are and copies back the ids (and the logprobs asked for) alone.
        if not self.on_device:
            logits = logits.cpu()
        if any(r.prompt_lp_targets or r.label_token_ids for r in sched.reqs):
            logits = self._prompt_logprobs(sched, logits, out)
        rows: list[SamplingRow] = []
        masked_rows: list[int] = []
        masks = []
        for r in sched.reqs:
            if r.sampling is not None:
                if r.token_bitmask is not None:
                    masked_rows.extend(range(len(rows), len(rows) + r.num_draft + 1))
                    masks.append(r.token_bitmask)
                rows.extend(_verify_rows(r))
        if not rows:
            return out
        mask = (np.concatenate(masks), masked_rows) if masks else None
        res = self.sampler.sample(logits, rows, mask)
        k = 0
        for i, r in enumerate(sched.reqs):
            if r.sampling is None:
                continue
            n = accepted_run(res.tokens[k : k + r.num_draft + 1], r.token_ids[r.num_tokens - r.num_draft :])
            out.tokens[i] = res.tokens[k : k + n]
            out.logprobs[i] = res.logprobs[k : k + n]
            out.top_logprobs[i] = res.top_logprobs[k : k + n]
            k += r.num_draft + 1
        return out

    @staticmethod
    def _pooled(sched: SchedulerOutput, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Each pooling request's rows of ``hidden`` (in batch order), summed in float64 on the host."""
        hidden = hidden.double().cpu()
        out.pooled = [None] * len(sched.reqs)
        k = 0
        for i, r in enumerate(sched.reqs):
            if r.pool_from >= 0:
                m = r.num_tokens - r.num_draft - r.pool_from
                out.pooled[i] = hidden[k : k + m].sum(0).numpy()
                k += m

    @staticmethod
    def _prompt_logprobs(
        sched: SchedulerOutput, logits: torch.Tensor, out: ModelRunnerOutput
    ) -> torch.Tensor:
        """Take the prompt-logprob rows and label rows out of ``logits`` (each request's come before
        its sampling rows), fill ``out.prompt_logprobs`` and ``out.label_logprobs``, and return the
        sampling rows alone."""
        n = len(sched.reqs)
        out.prompt_logprobs = [[] for _ in range(n)]
        out.prompt_top_logprobs = [[] for _ in range(n)]
        out.label_logprobs = [None] * n
        keep: list[int] = []
        k = 0
        for i, r in enumerate(sched.reqs):
            m = len(r.prompt_lp_targets or ())
            if m:
                lp = torch.log_softmax(logits[k : k + m].float(), dim=-1)
                target = torch.tensor(r.prompt_lp_targets, dtype=torch.long, device=logits.device)
                out.prompt_logprobs[i] = lp.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
                if r.prompt_lp_top:
                    v, ix = lp.topk(r.prompt_lp_top, dim=-1)
                    out.prompt_top_logprobs[i] = [list(zip(a, b)) for a, b in zip(ix.tolist(), v.tolist())]
                else:
                    out.prompt_top_logprobs[i] = [None] * m
                k += m
            if r.label_token_ids:
                lp = torch.log_softmax(logits[k].float(), dim=-1)
                out.label_logprobs[i] = lp[torch.tensor(r.label_token_ids, dtype=torch.long, device=lp.device)].tolist()
                k += 1
            if r.sampling is not None:
                keep.extend(range(k, k + r.num_draft + 1))
                k += r.num_draft + 1
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]


def accepted_run(draws: list[int], drafts: list[int]) -> int:
    """How many of the target's ``draws`` (one per verified position, ``len(drafts) + 1``) a request
    keeps: drafts while the draw equals them, then the draw at the first mismatch (or the bonus after
    the last draft). For drafts that are a fixed guess (n-gram) this is exactly rejection sampling:
    the output distribution is the target's."""
    for j, d in enumerate(drafts):
        if draws[j] != d:
            return j + 1
    return len(drafts) + 1


def _verify_rows(r: ScheduledReq) -> list[SamplingRow]:
    s = r.sampling
    if r.num_draft == 0:
        return [s]
    drafts = r.token_ids[r.num_tokens - r.num_draft :]
    rows = []
    for j in range(r.num_draft + 1):
        hist = None if s.output_ids is None else s.output_ids + drafts[:j]
        rows.append(SamplingRow(s.params, s.position + j, s.prompt_ids, hist))
    return rows
