"""N-gram drafts (SGLang's NGRAM, vLLM's prompt lookup): find the longest suffix of the request's
own prompt + output, ``min_window``..``max_window`` tokens, that occurred before, and propose the
tokens that followed its most recent earlier occurrence (that has ``k`` tokens after it). No extra model, no memory of its own.

Adaptive per request (``adaptive.py``): a request whose drafts keep failing pauses drafting.
"""

from __future__ import annotations

import numpy as np

from .adaptive import may_draft


class NgramProposer:
    def __init__(self, num_draft_tokens: int, min_window: int = 1, max_window: int = 12):
        self.k = num_draft_tokens
        self.min_window = min_window
        self.max_window = max_window

    def propose(self, req) -> list[int]:
        if not may_draft(req):
            return []
        return lookup(np.asarray(req.fill_ids, dtype=np.int64), self.k, self.min_window, self.max_window)


def lookup(seq: np.ndarray, k: int, min_window: int, max_window: int) -> list[int]:
    """Up to ``k`` tokens that followed the longest (then most recent) earlier occurrence of a
    suffix of ``seq`` of ``min_window``..``max_window`` tokens; [] when none occurred."""
    n = len(seq)
    if n < min_window + 1:
        return []
    # Candidates: earlier positions holding the last token; grow the match backwards from there.
    cand = np.flatnonzero(seq[: n - 1] == seq[n - 1])
    best, length = None, 0
    w = 1
    while cand.size and w <= max_window:
        if w >= min_window:
            best, length = cand, w
        if w == max_window:
            break
        back = cand - w
        keep = back >= 0
        cand = cand[keep]
        cand = cand[seq[back[keep]] == seq[n - 1 - w]]
        w += 1
    if best is None or length < min_window:
        return []
    # The most recent occurrence with k tokens after it, else the earliest (the longest continuation).
    full = best[best + k < n]
    start = int(full[-1] if full.size else best[0]) + 1
    return seq[start : start + k].tolist()
