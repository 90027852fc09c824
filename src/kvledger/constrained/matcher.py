"""One request's grammar matcher (``GrammarState``): it fills the bitmask of the positions a step
samples (several with speculative drafts, rolled back after) and accepts the tokens the request keeps,
on the engine's thread. An ambiguous grammar makes that work grow with the output
(``MASK_CPU_LIMIT_S``): past the limit the request ends (400, ``grammar_too_slow``) instead of slowing
every step. ``grammar.py``'s ``GrammarBackend`` compiles the grammar and makes the matcher."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import ValidationError
from .bitmask import bitmask_width

# A matcher's work for one position (a bitmask, an accepted token) is microseconds for JSON and most
# grammars. An ambiguous one makes xgrammar's Earley parser carry every way of reading the output so
# far, so the work grows with it (the regex (x+x+)+y, with every x), on the engine's thread, in
# every tenant's step. A position may take this much of
# the thread's CPU time (CPU time: a busy machine does not make it look slow); past it in
# MASK_STRIKES steps in a row (the first mask of a grammar can be slow once) the request ends.
MASK_CPU_LIMIT_S = 0.02
MASK_STRIKES = 3


class GrammarState:
    """One request's matcher."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.width = bitmask_width(vocab_size)
        self.strikes = 0  # steps in a row whose positions took more than MASK_CPU_LIMIT_S each
        self.slowest_s = 0.0  # the most CPU time one position took (named in the refusal)
        self._accept_s = 0.0  # CPU time of the accepts since the last masks (charged with them)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def too_slow(self) -> bool:
        """The matcher's work per position passed ``MASK_CPU_LIMIT_S`` in ``MASK_STRIKES`` steps in a row."""
        return self.strikes >= MASK_STRIKES

    def too_slow_error(self, kind: str) -> ValidationError:
        """The 400 that ends a request whose matcher is ``too_slow`` (``kind``: its grammar's field)."""
        return ValidationError(
            f"the {kind} is too costly to follow: matching one token took {self.slowest_s * 1e3:.0f} ms of "
            f"the engine's CPU time, over the {MASK_CPU_LIMIT_S * 1e3:g} ms a token may take, in {MASK_STRIKES} "
            "steps in a row (an ambiguous pattern such as (x+x+)+y does this); send an unambiguous one",
            param=kind,
            code="grammar_too_slow",
        )

    def _charge(self, t0: float, positions: int) -> None:
        """One step's matcher work: these masks and the accepts since the last ones (either may be
        where an ambiguous grammar spends its time)."""
        per = (time.thread_time() - t0 + self._accept_s) / max(positions, 1)
        self._accept_s = 0.0
        self.slowest_s = max(self.slowest_s, per)
        self.strikes = self.strikes + 1 if per > MASK_CPU_LIMIT_S else 0

    def drafts_before_end(self, drafts: list[int]) -> int:
        """How many of ``drafts`` may be verified: all of them, unless one ends the grammar (its stop
        token). Then only those before it: the request keeps nothing after the end, and a position
        after it has no mask to sample under; the target draws the stop token itself, at the last
        verified position. (A draft the grammar refuses stays: ``masks`` handles it.)"""
        m = self.matcher
        accepted = 0
        end = len(drafts)
        for j, t in enumerate(drafts):
            if not m.accept_token(t):
                break
            accepted += 1
            if m.is_terminated():
                end = j
                break
        if accepted:
            m.rollback(accepted)
        return end

    def masks(self, drafts: list[int]) -> np.ndarray:
        """Bitmasks for the ``1 + len(drafts)`` positions a step samples: position ``j`` as if the
        first ``j`` drafts were kept. After a draft the grammar refuses, the target's draw cannot
        equal it, so later positions are never kept: their rows repeat. No draft may end the grammar
        (``drafts_before_end``): nothing can be sampled after the end."""
        out = np.zeros((len(drafts) + 1, self.width), dtype=np.int32)
        view = torch.from_numpy(out)
        m = self.matcher
        accepted = 0
        t0 = time.thread_time()
        try:
            for j in range(len(drafts) + 1):
                m.fill_next_token_bitmask(view, j)
                if j == len(drafts):
                    break
                if not m.accept_token(drafts[j]):
                    out[j + 1 :] = out[j]
                    break
                accepted += 1
                if m.is_terminated():
                    raise RuntimeError("a draft ends the grammar (see drafts_before_end)")
        finally:
            if accepted:
                m.rollback(accepted)
            self._charge(t0, len(drafts) + 1)
        return out

    def accept(self, tokens: list[int]) -> bool:
        """Advance over the tokens the request kept; False if the grammar refuses one (a bug)."""
        t0 = time.thread_time()
        ok = all(self.matcher.accept_token(t) for t in tokens)
        self._accept_s += time.thread_time() - t0  # charged with the next masks
        return ok

