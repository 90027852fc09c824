"""Regular expressions a client sends (``stop_regex``, a schema's ``patternProperties``), on RE2.

Python's ``re`` backtracks: ``(x+x+)+y`` against forty ``x`` takes minutes, on whatever thread runs
it (the engine's, for a stop regex: every tenant's stream stops). RE2 matches in time linear in the
text, whatever the pattern, and bounds the memory a pattern may take (``MAX_MEM_BYTES``). What it
does not have needs backtracking (backreferences, lookaround, atomic groups, possessive quantifiers,
conditionals): such a pattern is refused with a 400 naming the feature, never handed to ``re``.

Patterns are compiled when the request is validated and kept in a small cache keyed by the pattern
(``compile_pattern``): the engine's stop checks take the compiled object from there, never compile
per token.
"""

from __future__ import annotations

import functools

import re2

from ..errors import ValidationError

# RE2 gives each compiled pattern this much memory for its program and its DFA cache (past it RE2
# refuses the pattern, or falls back to its slower, still linear, NFA). Patterns are short (a stop
# regex: --max-stop-string-len characters), so 1 MiB is plenty and bounds CACHE_SIZE patterns' memory.
MAX_MEM_BYTES = 1 << 20
CACHE_SIZE = 256  # distinct patterns kept compiled (least recently used go first)

# RE2's error (its operator or escape) -> the feature a client used, for the 400's message.
_FEATURES: tuple[tuple[str, str], ...] = (
    ("invalid perl operator: (?=", "lookahead (?=...)"),
    ("invalid perl operator: (?!", "negative lookahead (?!...)"),
    ("invalid perl operator: (?<=", "lookbehind (?<=...)"),
    ("invalid perl operator: (?<!", "negative lookbehind (?<!...)"),
    ("invalid perl operator: (?>", "an atomic group (?>...)"),
    ("invalid perl operator: (?P", "a named backreference or recursion ((?P=name), (?P>name))"),
    ("invalid perl operator: (?#", "a comment group (?#...)"),
    ("invalid perl operator: (?|", "a branch reset group (?|...)"),
    ("invalid perl operator: (?(", "a conditional group (?(...)...)"),
    ("invalid perl operator: (?R", "recursion (?R)"),
    ("invalid escape sequence: \\k", "a named backreference \\k<name>"),
    ("invalid escape sequence: \\g", "a backreference \\g<...>"),
    ("invalid escape sequence: \\Z", "\\Z (RE2 writes the end of the text as \\z)"),
    ("invalid escape sequence: \\G", "\\G (a match continuing the previous one)"),
    ("invalid repetition size", "a repetition count above 1000"),
    ("bad repetition operator: {", "a repetition of a repetition (a{2}{3}, or a possessive a{2}+)"),
    ("pattern too large", f"more states than the {MAX_MEM_BYTES >> 20} MiB a pattern may take"),
)
_POSSESSIVE = ("bad repetition operator: *+", "bad repetition operator: ++", "bad repetition operator: ?+")


def _feature(reason: str) -> str | None:
    """The unsupported feature RE2's error names (None: a pattern that is simply malformed)."""
    if reason.startswith(_POSSESSIVE):
        return "a possessive quantifier (*+, ++, ?+)"
    if reason.startswith("invalid escape sequence: \\") and reason[-1:].isdigit():
        return f"a backreference {reason.rsplit(': ', 1)[1]}"
    return next((f for prefix, f in _FEATURES if reason.startswith(prefix)), None)


def _options() -> re2.Options:
    o = re2.Options()
    o.max_mem = MAX_MEM_BYTES
    o.log_errors = False  # refusals are the client's, answered with a 400; not the server log's
    return o


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compile(pattern: str):
    return re2.compile(pattern, _options())


def compile_pattern(pattern: str, param: str):
    """``pattern`` compiled by RE2 (cached by pattern); a ``ValidationError`` on ``param`` naming the
    feature RE2 lacks (code ``unsupported_regex``), or why it does not parse (``invalid_regex``)."""
    try:
        return _compile(pattern)
    except re2.error as e:
        reason = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
    feature = _feature(reason)
    if feature is not None:
        raise ValidationError(
            f"{param} {pattern!r} uses {feature}, which needs a backtracking matcher; patterns are matched "
            "with RE2 (linear time), so rewrite it without that",
            param=param,
            code="unsupported_regex",
        )
    raise ValidationError(f"{param} {pattern!r} does not compile: {reason}", param=param, code="invalid_regex")


def search(pattern: str, text: str) -> bool | None:
    """Whether ``pattern`` matches somewhere in ``text`` (RE2, linear time); None when RE2 cannot
    read the pattern."""
    try:
        return _compile(pattern).search(text) is not None
    except (re2.error, TypeError):
        return None
