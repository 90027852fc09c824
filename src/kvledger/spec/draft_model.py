"""STANDALONE drafts: a small draft model of the same tokenizer proposes ``k`` tokens greedily.

Its KV lives in the same ledger without a state of its own: a second ``KVBuffer`` (the draft
model's shape) indexed by the same cache locations, so the draft K/V of page ``p`` belongs to whoever
owns page ``p`` — the request, the radix tree or a session — and is allocated and released with it,
through the same one path. The policy allocates the drafts' pages (lookahead) before asking for
them and gives back what is not used; rejected drafts' pages go back in the verify step.

Which positions hold valid draft K/V is ``req.spec.draft_end`` (capped by the request's KV, so a
truncate or a retraction invalidates what it gave back); after an admission (first, after a
retraction, a session turn) the draft recomputes the sequence from 0, prefix pages included — their
draft K/V is a function of their tokens, so rewriting it is harmless to other readers.

Drafts are the draft model's argmax, fixed guesses: the runner's verification (the target's own
draw at each position) is then exact rejection sampling, greedy or not.
"""

from __future__ import annotations

import torch

from ..memory import KVBuffer
from ..model import ForwardBatch, LlamaModel
from .adaptive import may_draft


class DraftModelProposer:
    writes_kv = True  # the policy allocates the drafts' pages before ``propose``

    def __init__(self, model: LlamaModel, num_tokens: int, page_size: int, num_draft_tokens: int):
        mc = model.cfg
        self.model = model
        self.k = num_draft_tokens
        self.page_size = page_size
        self.kv_buffer = KVBuffer(
            mc.num_layers, num_tokens, mc.num_kv_heads, mc.head_dim, model.dtype, model.device
        )
        self._offsets = torch.arange(page_size)

    def num_drafts(self, req, limit: int) -> int:
        """How many drafts to make room for (0: none this step)."""
        room = self.model.cfg.max_position_embeddings - req.seq_len - 1
        return max(0, min(self.k, limit, room)) if may_draft(req) else 0

    def propose(self, req, k: int) -> list[int]:
        """``k`` greedy drafts after ``req``'s last token; its pages cover their positions."""
        spec = req.spec
        if spec.draft_admit != req.admitted_seq:  # a new admission: nothing here is known valid
            spec.draft_admit, spec.draft_end = req.admitted_seq, 0
        start = min(spec.draft_end, req.kv_len)
        n = req.seq_len
        row = (torch.tensor(req.pages).unsqueeze(1) * self.page_size + self._offsets).reshape(1, -1)
        row = row.to(self.model.device)
        tok = self._forward(req.tokens(start, n), start, row)
        drafts = [tok]
        for j in range(1, k):
            tok = self._forward([tok], n - 1 + j, row)
            drafts.append(tok)
        spec.draft_end = n + k - 1  # K/V written up to the second-to-last draft
        return drafts

    def _forward(self, ids: list[int], start: int, row: torch.Tensor) -> int:
        t = len(ids)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.arange(start, start + t),
            out_loc=row[0, start : start + t],
            req_rows=[0],
            prefix_lens=[start],
            extend_lens=[t],
            seq_lens=[start + t],
            logit_index=torch.tensor([t - 1]),
            req_to_token=row,
            page_size=self.page_size,
        ).to(self.model.device)
        return int(self.model.forward(batch, self.kv_buffer)[0].argmax())
