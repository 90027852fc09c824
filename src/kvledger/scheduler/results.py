"""A step's results applied to its requests: the second half of a step, row by row.

``ResultApplier`` takes each row of the executor's ``ModelRunnerOutput`` (0..k tokens per request)
to its request: the tokens through the stop checks (``stop.py``), the grammar matcher advanced,
the KV length set (rejected drafts given back with ``truncate``), prompt logprobs and pooled rows
kept, speculative counts recorded; and describes what the row brought as a ``RequestOutput`` for the
scheduler to emit. A row of an overlapped step (``overlap.py``) replaces its placeholder; a request
whose KV a connector brought takes the remote side's first token (``join_received``).

It marks requests (``Req.mark_finish``) and never finishes them: the scheduler does that at its safe
point, through the one release path.
"""

from __future__ import annotations

import logging

from ..common import FinishReason, RequestOutput
from ..common.pooling import normalized
from ..connector import KVConnector
from ..constrained import grammar_spec
from ..memory import KVManager
from .output import ModelRunnerOutput, ScheduledReq, SchedulerOutput
from .overlap import Flight, placeholder
from .request import Req, ReqState, SpecState
from .stop import StopChecker

log = logging.getLogger(__name__)


class ResultApplier:
    """Applies result rows to requests; each call returns the row's ``RequestOutput`` (or None when
    it brought nothing a client sees)."""

    def __init__(self, stop: StopChecker, kv_manager: KVManager, spec_totals: SpecState):
        self.stop = stop
        self.kv_manager = kv_manager
        self.spec_totals = spec_totals  # every verify step of every request (the scheduler's)

    def apply_rows(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, flight: Flight | None, reqs: dict[str, Req]
    ) -> list[RequestOutput]:
        """Every row of step ``sched``; ``flight`` is the step's record when it was launched ahead
        (``overlap.py``), ``reqs`` the scheduler's request table."""
        outs = []
        for i, sr in enumerate(sched.reqs):
            if flight is None:
                outs.append(self.apply(reqs[sr.rid], sr, result, i))
                continue
            req = flight.reqs[i]
            if req.state in (ReqState.FINISHED, ReqState.SENDING):
                continue  # (overlap) it ended after this step was launched: the row is dropped
            if flight.overlapped[i]:
                outs.append(self.apply_overlapped(req, sr, result, i))
            else:
                outs.append(self.apply(req, sr, result, i))
        return [o for o in outs if o is not None]

    def apply(self, req: Req, sr: ScheduledReq, result: ModelRunnerOutput, i: int) -> RequestOutput | None:
        if result.errors is not None and result.errors[i] is not None:
            log.error("request %s failed: %s", req.rid, result.errors[i])
            msg = f"engine error while computing this request: {result.errors[i]}"
            req.mark_finish(FinishReason("abort", msg, status=500))
            return None
        fed_end = sr.start + sr.num_tokens
        tokens = result.tokens[i]
        new_input = 0
        if sr.prompt_lp_targets and result.prompt_logprobs is not None:
            new_input = len(result.prompt_logprobs[i])
            req.input_logprobs.extend(result.prompt_logprobs[i])
            req.input_top_logprobs.extend(result.prompt_top_logprobs[i])
        if req.pooling is not None:
            take_pooled(req, sr, result, i)
        if not tokens:
            req.kv_len = fed_end - sr.num_draft
            if req.params.scoring and req.kv_len >= req.seq_len:
                req.mark_finish(FinishReason("length"))  # scored: nothing to generate
            return output(req, 0, new_input) if new_input else None
        if sr.num_draft:
            req.spec.record(sr.num_draft, len(tokens) - 1)
            self.spec_totals.record(sr.num_draft, len(tokens) - 1)
        before = req.seq_len
        n = self.stop.append(req, tokens, result.logprobs[i], result.top_logprobs[i])
        if req.grammar is not None:
            advance_grammar(req, n)
        # Valid KV: what was fed up to the last accepted draft; the newest token is not in the KV yet.
        req.kv_len = min(fed_end, before + n - 1)
        if fed_end > req.kv_len:
            self.kv_manager.truncate(req, req.kv_len)  # rejected drafts' positions go back to the pool
        return output(req, n, new_input)

    def apply_overlapped(
        self, req: Req, sr: ScheduledReq, result: ModelRunnerOutput, i: int
    ) -> RequestOutput | None:
        """A row advanced at launch (``InFlight.launch``): its KV length is set already; a sampled
        token takes its placeholder's place, through the same stop checks as in ``apply``. Tokens of
        later steps' placeholders stay after it unless this one ends the request."""
        if result.errors is not None and result.errors[i] is not None:
            return self.apply(req, sr, result, i)  # the 500, as a synchronous step
        if sr.future < 0:
            return None  # a prefill chunk that samples nothing
        tokens, ids, ph = result.tokens[i], req.output_ids, placeholder(sr.future)
        if ph not in ids:
            return None  # an earlier result re-planned the request (below): this row is dropped
        k = len(ids) - 1 - ids[::-1].index(ph)
        later = ids[k + 1 :]
        del ids[k:]
        if len(tokens) != 1:
            # Not the one token the next step was planned on (an executor may give 0..k, seams): the
            # later placeholders go (their rows are dropped) and the request goes on from the KV this
            # row computed, as after a synchronous step (a jump forward computes the rest next).
            if req.state is ReqState.RUNNING:
                req.kv_len = min(req.kv_len, sr.start + sr.num_tokens)
                return self.apply(req, sr, result, i)
            later = []
        n = self.stop.append(req, tokens, result.logprobs[i], result.top_logprobs[i])
        if req.grammar is not None:
            advance_grammar(req, n)
        out = output(req, n, 0)
        if req.to_finish is None:
            ids.extend(later)
        return out

    def join_received(self, req: Req, connector: KVConnector) -> RequestOutput | None:
        """A request whose whole prompt's KV arrived takes the remote side's first token (PD's
        "prebuilt" step: no forward). The stop checks run on it like on any token, so a request it
        ends (max_new_tokens 1, EOS) finishes at the next safe point through the one release path,
        every release hook included (seed 003). Without a token the last prompt position is
        recomputed here."""
        got = connector.received_output(req) if req.kv_len >= req.seq_len else None
        if got is None:
            req.kv_len = min(req.kv_len, req.seq_len - 1)
            return None
        # Served from a cache: decode's own prefix match, or prefill's where it reached further.
        req.cached_tokens = max(req.cached_tokens, got.cached_tokens)
        n = self.stop.append(req, got.tokens, got.logprobs, got.top_logprobs)
        if req.grammar is not None:
            advance_grammar(req, n)
        req.kv_len = req.seq_len - 1
        return output(req, n, 0)


def take_pooled(req: Req, sr: ScheduledReq, result: ModelRunnerOutput, i: int) -> None:
    """Mean pooling adds this chunk's rows to the sum (positions ``start + pool_from`` to the chunk's
    end); last pooling keeps the last position's; a score keeps the label logprobs."""
    if sr.pool_from >= 0 and result.pooled is not None and result.pooled[i] is not None:
        end = sr.start + sr.num_tokens
        if req.pooling.mean:
            if sr.start + sr.pool_from != req.pooled_count:
                raise RuntimeError(f"request {req.rid}: mean pooling skipped positions")
            req.pooled = result.pooled[i] if req.pooled is None else req.pooled + result.pooled[i]
        else:
            req.pooled = result.pooled[i]
        req.pooled_count = end
    if sr.label_token_ids and result.label_logprobs is not None:
        req.label_logprobs = result.label_logprobs[i]


def output(req: Req, n: int, new_input: int) -> RequestOutput:
    """This step's news for ``req``: its last ``n`` output tokens and ``new_input`` prompt logprobs."""
    out = RequestOutput(
        req.rid,
        req.output_ids[len(req.output_ids) - n :],
        req.output_logprobs[len(req.output_logprobs) - n :],
        req.output_top_logprobs[len(req.output_top_logprobs) - n :],
        False,
        None,
        len(req.input_ids),
        len(req.output_ids),
        req.cached_tokens,
        req.spec.verify_ct,
    )
    if new_input:
        k = len(req.input_logprobs) - new_input  # (token 0's None is the reader's to add)
        out.input_logprobs = req.input_logprobs[k:]
        out.input_top_logprobs = req.input_top_logprobs[k:]
    return out


def final_output(req: Req, reason: FinishReason) -> RequestOutput:
    """The last output of a request that ends with ``reason`` (its pooled embedding or label logprobs
    unless aborted)."""
    out = RequestOutput.final(req.rid, reason, len(req.input_ids), len(req.output_ids), req.cached_tokens)
    out.spec_verify_ct = req.spec.verify_ct
    if req.pooling is not None and reason.type != "abort":
        if req.pooled is not None:
            out.embedding = normalized(req.pooled, req.pooled_count, req.pooling.mean)
        out.label_logprobs = req.label_logprobs
    return out


def advance_grammar(req: Req, n: int) -> None:
    """The matcher follows the tokens the request kept; a grammar that has ended (its stop token
    accepted, e.g. under ignore_eos) ends the request."""
    kept = req.output_ids[-n:]
    if not req.grammar.accept(kept):
        log.error("request %s: the grammar refused a token it allowed (%s)", req.rid, kept)
        req.mark_finish(FinishReason("abort", "structured output failed: a token broke the grammar", status=500))
    elif req.grammar.terminated:
        req.mark_finish(FinishReason("stop", matched=kept[-1]))
    elif req.grammar.too_slow:
        req.mark_finish(_grammar_too_slow(req))


def _grammar_too_slow(req: Req) -> FinishReason:
    """A request whose grammar costs the engine's thread too much per token (``constrained/grammar.py``,
    MASK_CPU_LIMIT_S): it ends before it slows every other request's steps further."""
    spec = grammar_spec(req.params)
    return FinishReason.from_error(req.grammar.too_slow_error(spec.kind if spec is not None else "grammar"))
