"""Prefill paced by measured step costs (``--mixed-step-ratio``): while requests decode, a step brings
only as many prompt tokens as keep their next token within R decode steps of the running batch.

Why: a prompt chunk that runs while others decode delays every one of their next tokens by the
chunk's whole cost. On a 2-core CPU a 128-token chunk of a 1.2B model costs ~8 decode steps of
8 streams, so the streams' inter-token latency p99 was 8-9x its p50 (issue 54). vLLM and SGLang cap
the tokens of a step (``max_num_batched_tokens``, ``chunked_prefill_size`` with mixed chunks); a
fixed cap is right for one model on one machine only, so here the cap is derived from the costs the
engine measures, for the policy's two shapes of a step while requests decode:

- unmixed (the CPU's default: the decodes' own step runs every layer in one C++ call, which a mixed
  forward cannot): a prompt step, then a decode step; the running streams' gap is both, so the prompt
  step gets ``B`` tokens with ``P(B) + D(n) <= R * D(N)`` (``prefill_budget``);
- mixed (``--enable-mixed-chunk``): one forward of the decodes and the chunk; ``M(n + B) <= R * D(N)``
  (``mixed_budget``),

where ``n`` is the decode rows now and ``N`` the rows of the batch being formed (running and waiting
requests, up to ``max_running_requests``: the decode step the streams will see most, their ITL p50).

Each of D (decode-only forwards), P (prompt-only forwards) and M (every forward) is a line
``w + c * rows`` (``w``: what every forward pays, the weights' read and the host's work; ``c``: a
row's share) fitted by least squares over the recent forwards of its kind, older ones weighted down
(``DECAY`` a forward), from the timings the engine reports (``EngineCore._execute``). Attention's
growth with the context is not modelled: at long contexts decodes cost more than a fit from short
ones says.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)

DECAY = 0.99
"""Weight a step's observation loses per later step (~100 steps of memory)."""
MIN_SPREAD_ROWS = 2.0
"""The fit needs steps of different sizes: below this standard deviation of the rows, the last good
fit is kept (a run of same-sized decode steps says nothing about the cost of a row)."""
MIN_PREFILL_TOKENS = 8
"""The least prompt tokens a paced step brings, so a prompt always advances (a ratio close to 1)."""


class LinearCost:
    """A forward's measured cost as ``w + c * rows``, fitted over the recent forwards of one kind."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self._s0 = self._s1 = self._s2 = self._st = self._sxt = 0.0
        self.fit: tuple[float, float] | None = None  # (w, c) in seconds, the last good fit
        self.observed = 0

    def observe(self, rows: int, seconds: float) -> None:
        d, x = self.decay, float(rows)
        self._s0 = self._s0 * d + 1.0
        self._s1 = self._s1 * d + x
        self._s2 = self._s2 * d + x * x
        self._st = self._st * d + seconds
        self._sxt = self._sxt * d + x * seconds
        self.observed += 1
        mean = self._s1 / self._s0
        var = self._s2 / self._s0 - mean * mean
        if var < MIN_SPREAD_ROWS**2:
            return
        c = (self._sxt / self._s0 - mean * self._st / self._s0) / var
        if c <= 0:
            return  # noise: larger forwards measured cheaper; keep the last good fit
        self.fit = (max(self._st / self._s0 - c * mean, 0.0), c)

    def predict(self, rows: int) -> float | None:
        """Seconds for a forward of ``rows``; without a fit, the mean of what was observed (a run of
        same-sized decode steps); None before any observation."""
        if self.fit is not None:
            return self.fit[0] + self.fit[1] * rows
        return self._st / self._s0 if self._s0 else None


class StepCosts:
    """The three fits (decode-only, prompt-only, every forward); ``observe`` from the thread that times
    the forward (with overlap scheduling, the forward thread: plain float updates)."""

    def __init__(self, decay: float = DECAY):
        self.decode = LinearCost(decay)
        self.prefill = LinearCost(decay)
        self.mixed = LinearCost(decay)

    def observe(self, decode_rows: int, prefill_rows: int, seconds: float) -> None:
        """A forward of ``decode_rows`` decode rows (one fed token each, drafts added) and
        ``prefill_rows`` prompt tokens took ``seconds``."""
        rows = decode_rows + prefill_rows
        if rows <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        self.mixed.observe(rows, seconds)
        if not prefill_rows:
            self.decode.observe(rows, seconds)
        elif not decode_rows:
            self.prefill.observe(rows, seconds)
        log.debug("forward: %d decode rows, %d prompt tokens, %.1f ms", decode_rows, prefill_rows, seconds * 1e3)

    @staticmethod
    def _tokens(fit: tuple[float, float] | None, allowed: float | None, cap: int) -> int:
        if fit is None or allowed is None:
            return cap
        w, c = fit
        # (+1e-9: a budget that fits exactly is not lost to the division's rounding)
        return max(min(int((allowed - w) / c + 1e-9), cap), min(MIN_PREFILL_TOKENS, cap))

    def prefill_budget(self, decode_rows: int, batch_rows: int, ratio: float, cap: int) -> int:
        """Unmixed: prompt tokens of a prompt-only step followed by a decode step of ``decode_rows``,
        the two within ``ratio`` decode steps of ``batch_rows`` rows; in [``MIN_PREFILL_TOKENS``,
        ``cap``], ``cap`` until both kinds of forward were measured."""
        ref = self.decode.predict(max(batch_rows, decode_rows))
        now = self.decode.predict(decode_rows)
        allowed = None if ref is None or now is None else ratio * ref - now
        return self._tokens(self.prefill.fit, allowed, cap)

    def mixed_budget(self, decode_rows: int, batch_rows: int, ratio: float, cap: int) -> int:
        """Mixed: prompt tokens beside ``decode_rows`` decode rows in one forward that costs at most
        ``ratio`` decode steps of ``batch_rows`` rows; bounds as ``prefill_budget``."""
        ref = self.decode.predict(max(batch_rows, decode_rows))
        n = self._tokens(self.mixed.fit, None if ref is None else ratio * ref, cap + decode_rows)
        return max(min(n - decode_rows, cap), min(MIN_PREFILL_TOKENS, cap))
