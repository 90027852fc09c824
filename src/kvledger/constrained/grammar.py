"""Grammars for constrained decoding, on xgrammar.

``GrammarBackend`` (one per engine) compiles a request's grammar once, cached and bounded by
xgrammar's compiler cache; a grammar that does not compile is a 400 naming the problem, raised before
the request holds anything. ``GrammarState`` is one request's matcher: it fills the bitmask of the
positions a step samples (several with speculative drafts, rolled back after) and accepts the tokens
the request keeps. Retraction needs nothing: the matcher follows the output, which a retracted
request keeps; chunked prefill samples nothing until its last chunk.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..common.sampling import GRAMMAR_KINDS, SamplingParams
from ..errors import ValidationError
from .bitmask import bitmask_width
from .keywords import unsupported_keywords
from .reasoning import ReasoningGate

log = logging.getLogger(__name__)

CACHE_LIMIT_BYTES = 256 * 2**20  # compiled grammars kept (xgrammar evicts beyond this)
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

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

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
        return out

    def accept(self, tokens: list[int]) -> bool:
        """Advance over the tokens the request kept; False if the grammar refuses one (a bug)."""
        return all(self.matcher.accept_token(t) for t in tokens)


class GrammarBackend:
    """xgrammar's compiler for one tokenizer; made on the first constrained request (importing
    xgrammar and indexing the vocabulary takes ~2 s, which a server that never sees one skips)."""

    def __init__(
        self, tokenizer, vocab_size: int, stop_token_ids: list[int], reasoning_end_ids: list[int] | None = None
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.reasoning_end_ids = reasoning_end_ids  # --reasoning-parser: where a reasoning request's grammar starts
        self._compiler = None

    def _xgr(self):
        import xgrammar as xgr

        if self._compiler is None:
            if self.tokenizer is None:
                raise ValidationError(
                    "structured outputs need the model's tokenizer, and this model has none"
                )
            t0 = time.perf_counter()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
            log.info("structured outputs ready in %.2fs (xgrammar)", time.perf_counter() - t0)
        return xgr

    def new_state(self, spec: GrammarSpec, after_reasoning: bool = False):
        """Compile (or take from the cache) and start a matcher; ValidationError if it does not compile
        or uses a keyword that is not enforced. ``after_reasoning`` (a request's ``require_reasoning``):
        the matcher starts once the reasoning's end marker is generated (a ``ReasoningGate`` around it)."""
        state = self._new_state(spec)
        if not after_reasoning:
            return state
        if self.reasoning_end_ids is None:  # validation refuses this first; a direct caller gets the same
            raise ValidationError(
                "require_reasoning needs a server started with --reasoning-parser", param="require_reasoning"
            )
        return ReasoningGate(state, self.reasoning_end_ids)

    def _new_state(self, spec: GrammarSpec) -> GrammarState:
        if spec.kind == "json_schema" and spec.source != ANY_JSON:
            grammar = json_schema_grammar(json.loads(spec.source), "json_schema", "json_schema")
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


def json_schema_grammar(schema, param: str, what: str):
    """The grammar of a JSON schema (an ``xgrammar.Grammar``), compact and in strict mode, wherever a
    schema enters (``response_format``, ``json_schema``, a tool's ``parameters``). A keyword that is
    not enforced is a ValidationError ``unsupported_schema``, a schema that does not compile one
    ``invalid_grammar``; ``what`` names the schema in the message, ``param`` the field."""
    import xgrammar as xgr  # lazy: ~2 s, only for servers that see a constrained request

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
