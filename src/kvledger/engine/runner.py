"""Model runner: turns a scheduled batch into a ``ForwardBatch``, runs the model, samples."""

from __future__ import annotations

import os

import torch

from ..memory import KVBuffer
from ..model import ForwardBatch, LlamaModel, Sampler, SampleResult, SampleRow
from ..scheduler.request import Req


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv: KVBuffer, req_to_token: torch.Tensor, page_size: int, seed: int = 0
    ):
        self.page_size = page_size
        # Test-only fault injection: a batch holding one of these rids raises, as a kernel bug would.
        self.fault_rids = {r for r in os.environ.get("KVLEDGER_TEST_FAULT_RIDS", "").split(",") if r}
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.sampler = Sampler(seed)

    def build(self, work: list[tuple[Req, int]]) -> tuple[ForwardBatch, list[int]]:
        """Flatten ``work`` (request, number of new tokens). Returns the batch and the indices (into
        ``work``) of the requests that reach their end in this forward and so need a token sampled."""
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        out_loc: list[torch.Tensor] = []
        logit_index: list[int] = []
        sample_at: list[int] = []
        rows, prefix, ext, seq = [], [], [], []
        t = 0
        for j, (req, n) in enumerate(work):
            if req.rid in self.fault_rids:
                raise RuntimeError(f"injected fault for request {req.rid}")
            a, b = req.kv_len, req.kv_len + n
            lp = len(req.input_ids)
            # Slice prompt and output separately: no full concatenation per decode step.
            if a >= lp:
                ids.extend(req.output_ids[a - lp : b - lp])
            else:
                ids.extend(req.input_ids[a:b])
                if b > lp:
                    ids.extend(req.output_ids[: b - lp])
            positions.append(torch.arange(a, b))
            out_loc.append(self.req_to_token[req.slot, a:b])
            rows.append(req.slot)
            prefix.append(a)
            ext.append(n)
            seq.append(b)
            t += n
            if b == req.seq_len:
                logit_index.append(t - 1)
                sample_at.append(j)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(positions),
            out_loc=torch.cat(out_loc),
            req_rows=rows,
            prefix_lens=prefix,
            extend_lens=ext,
            seq_lens=seq,
            logit_index=torch.tensor(logit_index, dtype=torch.int64),
            req_to_token=self.req_to_token,
            page_size=self.page_size,
        )
        return batch, sample_at

    def run(self, work: list[tuple[Req, int]]) -> tuple[list[int], SampleResult | None]:
        batch, sample_at = self.build(work)
        logits = self.model.forward(batch, self.kv)
        if not sample_at:
            return sample_at, None
        rows = []
        for j in sample_at:
            req = work[j][0]
            rows.append(SampleRow(req.params, req.input_ids, req.output_ids, req.generator))
        return sample_at, self.model_sample(logits, rows)

    def model_sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        return self.sampler.sample(logits, rows)
