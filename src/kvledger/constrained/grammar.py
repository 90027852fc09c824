"""Grammars for constrained decoding, on xgrammar.

``GrammarBackend`` (one per engine) compiles a request's grammar once, cached and bounded by
xgrammar's compiler cache, on its own threads (``start``): a compile never runs on the engine's
thread, so a grammar that is slow to compile delays only its own request. The request waits in the
scheduler's ``compiling`` list, holding nothing, until its ``GrammarJob`` gives the matcher; one that
does not compile is a 400 naming the problem, one that takes longer than
``--grammar-compile-timeout-s`` a 400 (``grammar_compile_timeout``), both ending it through the one
release path before it holds anything. The grammar's text was bounded before (``--max-grammar-len``,
``--max-grammar-depth``: ``common/grammar_bounds.check_grammar_bounds``).

``GrammarState`` is one request's matcher: it fills the bitmask of the positions a step samples
(several with speculative drafts, rolled back after) and accepts the tokens the request keeps, on the
engine's thread. An ambiguous grammar makes that work grow with the output (``MASK_CPU_LIMIT_S``):
past the limit the request ends (400, ``grammar_too_slow``) instead of slowing every step. Retraction
needs nothing: the matcher follows the output, which a retracted request keeps; chunked prefill
samples nothing until its last chunk.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..common.grammar_bounds import MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_LEN, check_grammar_bounds, grammar_too_deep
from ..common.sampling import GRAMMAR_KINDS, SamplingParams
from ..errors import KVLedgerError, ValidationError, error_for_status
from .bitmask import bitmask_width
from .jobs import CompilePool, GrammarJob
from .keywords import unsupported_keywords
from .reasoning import ReasoningGate

log = logging.getLogger(__name__)

CACHE_LIMIT_BYTES = 256 * 2**20  # compiled grammars kept (xgrammar evicts beyond this)
COMPILE_THREADS = 2  # grammars compiling at once; more wait their turn (their deadline runs meanwhile)
DEFAULT_COMPILE_TIMEOUT_S = 30.0  # --grammar-compile-timeout-s
# A matcher's work for one position (a bitmask, an accepted token) is microseconds for JSON and most
# grammars. An ambiguous one makes xgrammar's Earley parser carry every way of reading the output so
# far, so the work grows with it (the regex (x+x+)+y, with every x), on the engine's thread, in
# every tenant's step. A position may take this much of
# the thread's CPU time (CPU time: a busy machine does not make it look slow); past it in
# MASK_STRIKES steps in a row (the first mask of a grammar can be slow once) the request ends.
MASK_CPU_LIMIT_S = 0.02
MASK_STRIKES = 3
# JSON is generated compactly (xgrammar's any_whitespace=False): small models given free whitespace
# tend to emit it until max_new_tokens, and the output is the same JSON either way. Schemas compile
# in strict mode (an object's unlisted properties are not generated), as OpenAI's strict mode asks.


ANY_JSON = "$$ANY$$"  # SGLang's json_schema value for "any JSON object" (OpenAI's json_object)


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json_schema" | "regex" | "ebnf"
    source: str


def grammar_spec(p: SamplingParams) -> GrammarSpec | None:
    """The request's grammar (validation allows at most one kind)."""
    for kind in GRAMMAR_KINDS:
        v = getattr(p, kind)
        if v is not None:
            return GrammarSpec(kind, v)
    return None


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


class GrammarBackend:
    """xgrammar's compiler for one tokenizer; made on the first constrained request (importing
    xgrammar and indexing the vocabulary takes ~2 s, which a server that never sees one skips)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        reasoning_end_ids: list[int] | None = None,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.reasoning_end_ids = reasoning_end_ids  # --reasoning-parser: where a reasoning request's grammar starts
        self.compile_timeout_s = compile_timeout_s
        self._compiler = None
        self._compiler_lock = threading.Lock()  # the compile threads make it once
        self._pool = CompilePool(COMPILE_THREADS)

    def _xgr(self):
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                t0 = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
                log.info("structured outputs ready in %.2fs (xgrammar)", time.perf_counter() - t0)
        return xgr

    def start(self, spec: GrammarSpec, after_reasoning: bool = False) -> GrammarJob:
        """Start compiling ``spec`` (or taking it from the cache) on the backend's threads; the job
        gives the request's matcher (``poll``, ``wait``). What needs no compile is refused here, at
        once: a model without tokenizer, ``after_reasoning`` without a reasoning parser.
        ``after_reasoning`` (a request's ``require_reasoning``): the matcher starts once the reasoning's
        end marker is generated (a ``ReasoningGate`` around it)."""
        if self.tokenizer is None:
            raise ValidationError(
                "structured outputs need the model's tokenizer, and this model has none", param=spec.kind
            )
        if after_reasoning and self.reasoning_end_ids is None:  # validation refuses this first
            raise ValidationError(
                "require_reasoning needs a server started with --reasoning-parser", param="require_reasoning"
            )
        end_ids = self.reasoning_end_ids

        def wrap(state: GrammarState) -> object:
            return ReasoningGate(state, end_ids) if after_reasoning else state

        return GrammarJob(spec.kind, self._pool.submit(self._compile, spec), self.compile_timeout_s, wrap)

    def new_state(self, spec: GrammarSpec, after_reasoning: bool = False):
        """``start`` and wait for the job (callers that may block: the offline API, tests)."""
        return self.start(spec, after_reasoning).wait()

    def shutdown(self) -> None:
        self._pool.shutdown()

    def _compile(self, spec: GrammarSpec) -> GrammarState:
        """On a compile thread. An error xgrammar was not expected to raise is the server's (500)."""
        try:
            return self._new_state(spec)
        except KVLedgerError:
            raise
        except Exception as e:
            log.exception("compiling a %s failed", spec.kind)
            raise error_for_status(
                500, f"the {spec.kind} compiler failed: {type(e).__name__}: {e}", "grammar_compiler_error", spec.kind
            ) from None

    def _new_state(self, spec: GrammarSpec) -> GrammarState:
        if spec.kind == "json_schema" and spec.source != ANY_JSON:
            # (bounded by validation, with the server's limits)
            grammar = json_schema_grammar(json.loads(spec.source), "json_schema", "json_schema", bounds=None)
        else:
            grammar = None
        xgr = self._xgr()
        try:
            if grammar is not None:
                compiled = self._compiler.compile_grammar(grammar)
            elif spec.kind == "json_schema":
                # Any JSON object (OpenAI's json_object), compact like the rest.
                compiled = self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.source)
            else:
                compiled = self._compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValidationError(
                f"the {spec.kind} does not compile: {_reason(e)}", param=spec.kind, code="invalid_grammar"
            ) from None
        matcher = xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar >= 0.2
        return GrammarState(matcher, self.vocab_size)


# xgrammar 0.2.9 writes a string with minLength/maxLength as characters of [^"\\\r\n], which lets a
# raw control character (a tab) through: invalid JSON. Its other strings exclude them; so do these.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(
    schema, param: str, what: str, bounds: tuple[int, int] | None = (MAX_GRAMMAR_LEN, MAX_GRAMMAR_DEPTH)
):
    """The grammar of a JSON schema (an ``xgrammar.Grammar``), compact and in strict mode, wherever a
    schema enters (``response_format``, ``json_schema``, a tool's ``parameters``). A schema past
    ``bounds`` (characters, nesting: ``check_grammar_bounds``; None: checked already) is refused
    first, a keyword that is not enforced is a ValidationError ``unsupported_schema``, a schema that
    does not compile one ``invalid_grammar``; ``what`` names the schema in the message, ``param`` the
    field."""
    import xgrammar as xgr  # lazy: ~2 s, only for servers that see a constrained request

    if bounds is not None:
        try:
            text = json.dumps(schema)
        except RecursionError:  # deeper than Python's encoder goes: far past any bound
            raise grammar_too_deep(param, what, None, bounds[1]) from None
        except (TypeError, ValueError):
            raise ValidationError(f"{what} is not a JSON schema", param=param, code="invalid_grammar") from None
        check_grammar_bounds("json_schema", text, *bounds, param=param, what=what)
    bad = unsupported_keywords(schema)
    if bad:
        raise ValidationError(
            f"{what} uses keywords structured outputs cannot enforce: {'; '.join(bad)}. Remove them "
            "or check the output yourself",
            param=param,
            code="unsupported_schema",
        )
    try:
        text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
        return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValidationError(
            f"{what} does not compile: {_reason(e)}", param=param, code="invalid_grammar"
        ) from None


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ": " in text and ".cc:" in text.split(": ", 1)[0]:
        text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(e).__name__
