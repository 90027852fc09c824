"""Which drafts a decode verifies (speculative decoding), within the step's token budget.

A proposer that only reads the output (n-gram) proposes up to the budget, never past the context; a
draft model writes K/V for its drafts' positions, so their pages are allocated first and the lookahead
it did not use goes back. No drafts for a request that draws no token (scoring, pooling) or decodes
sparsely (HiSparse), and none past a token that would end the request's grammar.
"""

from __future__ import annotations

from ..memory import KVManager
from .request import Req


def choose_drafts(req: Req, budget: int, proposer, kv_manager: KVManager, context_length: int) -> list[int]:
    """The drafts ``req`` verifies this step (``proposer``: the Scheduler's, None without speculation)."""
    if proposer is None or budget <= 0 or req.params.scoring:
        return []  # (a request that draws no token, scoring or pooling, has nothing to verify)
    if req.sparse is not None:
        return []  # HiSparse attends one new token sparsely; a verify would need sparse extends
    limit = max(min(context_length - req.seq_len - 1, budget), 0)  # never past the context
    if not getattr(proposer, "writes_kv", False):
        return _before_grammar_end(req, proposer.propose(req)[:limit])
    # A draft model writes its K/V for the drafts' positions: their pages come first.
    want = proposer.num_drafts(req, limit)
    if not want or not kv_manager.allocate(req, 1, num_lookahead_tokens=want):
        return []
    drafts = _before_grammar_end(req, proposer.propose(req, want))
    kv_manager.truncate(req, req.seq_len + len(drafts))  # the lookahead it did not use goes back
    return drafts


def _before_grammar_end(req: Req, drafts: list[int]) -> list[int]:
    """Drafts cut before one that would end the request's grammar: a draft accepted there would let
    the step keep the target's next draw after the end (under ignore_eos nothing else stops it),
    which the grammar then refuses (fuzz seed 1779861933)."""
    if req.grammar is None or not drafts:
        return drafts
    return drafts[: req.grammar.drafts_before_end(drafts)]
