"""The adaptive rule every proposer follows, per request: each verify updates an exponential moving
average of the fraction of drafts accepted, ``ema = 0.7 * ema + 0.3 * accepted / drafted``
(``SpecState.record``). When it falls below ``PAUSE_BELOW`` the request gets no drafts for its next
``PAUSE_TOKENS`` output tokens, then tries again from ``ema = RETRY_EMA``; text that does not repeat
(or a draft model that does not agree with the target) then costs almost nothing."""

from __future__ import annotations

PAUSE_BELOW = 0.2
PAUSE_TOKENS = 16
RETRY_EMA = 0.5


def may_draft(req) -> bool:
    spec = req.spec
    if len(req.output_ids) < spec.paused_until:
        return False
    if spec.ema < PAUSE_BELOW:
        spec.paused_until = len(req.output_ids) + PAUSE_TOKENS
        spec.ema = RETRY_EMA
        return False
    return True
