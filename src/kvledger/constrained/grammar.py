"""Grammars for constrained decoding, on xgrammar.

``GrammarBackend`` (one per engine) compiles a request's grammar once, cached and bounded by
xgrammar's compiler cache, on its own threads (``start``): a compile never runs on the engine's
thread, so a grammar that is slow to compile delays only its own request. The request waits in the
scheduler's ``compiling`` list, holding nothing, until its ``GrammarJob`` gives the matcher; one that
does not compile is a 400 naming the problem, one that takes longer than
``--grammar-compile-timeout-s`` a 400 (``grammar_compile_timeout``), both ending it through the one
release path before it holds anything. The grammar's text was bounded before (``--max-grammar-len``,
``--max-grammar-depth``: ``common/grammar_bounds.check_grammar_bounds``).

``GrammarState`` (``matcher.py``) is one request's matcher, on the engine's thread; a JSON schema
becomes a grammar in ``json_schema.py``. Retraction needs nothing: the matcher follows the output,
which a retracted request keeps; chunked prefill samples nothing until its last chunk.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from ..common.sampling import GRAMMAR_KINDS, SamplingParams
from ..errors import KVLedgerError, ValidationError, error_for_status
from .jobs import CompilePool, GrammarJob
from .json_schema import compile_reason, json_schema_grammar
from .matcher import GrammarState
from .reasoning import ReasoningGate

log = logging.getLogger(__name__)

CACHE_LIMIT_BYTES = 256 * 2**20  # compiled grammars kept (xgrammar evicts beyond this)
COMPILE_THREADS = 2  # grammars compiling at once; more wait their turn (their deadline runs meanwhile)
DEFAULT_COMPILE_TIMEOUT_S = 30.0  # --grammar-compile-timeout-s

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
                f"the {spec.kind} does not compile: {compile_reason(e)}", param=spec.kind, code="invalid_grammar"
            ) from None
        matcher = xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar >= 0.2
        return GrammarState(matcher, self.vocab_size)

