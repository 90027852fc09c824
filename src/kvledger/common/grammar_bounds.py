"""A grammar's bounds (``--max-grammar-len``, ``--max-grammar-depth``), checked before anything parses it.

The characters of a json_schema, regex or ebnf as sent, and how deeply it nests (a JSON schema's
objects and arrays, a regex's or an EBNF's groups). xgrammar's work grows with both (a schema's
grammar with the square of its depth), and a deep one recurses in C++. Used by the one validation
(``validation.py``) and by the tool-call grammars (``constrained/grammar.py``).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ValidationError

MAX_GRAMMAR_LEN = 65536
MAX_GRAMMAR_DEPTH = 32


def _bad(param: str, message: str, code: str) -> ValidationError:
    return ValidationError(message, param=param, code=code)


def check_grammar_bounds(
    kind: str,
    text: str,
    max_len: int = MAX_GRAMMAR_LEN,
    max_depth: int = MAX_GRAMMAR_DEPTH,
    param: str | None = None,
    what: str | None = None,
) -> None:
    """A grammar (``kind``: json_schema, regex or ebnf) within ``max_len`` characters and ``max_depth``
    levels of nesting, and a json_schema valid JSON: else a 400 on ``param`` (default ``kind``) naming
    the limit (codes ``grammar_too_large``, ``grammar_too_deep``, ``invalid_grammar``). Checked before
    anything parses the grammar further, so that no parser recurses or works past the bounds."""
    param, what = param or kind, what or kind
    if len(text) > max_len:
        raise _bad(
            param,
            f"{what} has {len(text)} characters; a grammar may have at most {max_len} (--max-grammar-len)",
            "grammar_too_large",
        )
    if kind == "json_schema":
        if text == "$$ANY$$":  # SGLang's "any JSON"
            return
        try:
            depth = _json_depth(json.loads(text))
        except json.JSONDecodeError as e:
            raise _bad(param, f"{what} is not valid JSON: {e}", "invalid_grammar") from None
        except RecursionError:  # deeper than Python's parser goes: far past any bound
            raise grammar_too_deep(param, what, None, max_depth) from None
    else:
        depth = _regex_depth(text) if kind == "regex" else _ebnf_depth(text)
    if depth > max_depth:
        raise grammar_too_deep(param, what, depth, max_depth)


def grammar_too_deep(param: str, what: str, depth: int | None, max_depth: int) -> ValidationError:
    """The 400 for a grammar nesting ``depth`` levels (None: deeper than a parser could count)."""
    levels = f"{depth} levels" if depth is not None else f"more than {max_depth} levels"
    return _bad(
        param,
        f"{what} nests {levels} deep; a grammar may nest at most {max_depth} (--max-grammar-depth)",
        "grammar_too_deep",
    )


def _json_depth(v: Any) -> int:
    """How deeply a JSON value's objects and arrays nest (a scalar: 0), without recursion."""
    depth, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = x.values()
        elif not isinstance(x, list):
            continue
        depth = max(depth, d)
        stack.extend((y, d + 1) for y in x if isinstance(y, (dict, list)))
    return depth


def _regex_depth(text: str) -> int:
    """How deeply a regular expression's groups nest (escapes and character classes skipped)."""
    depth = top = 0
    i, n, in_class = 0, len(text), False
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 2 if text[i + 1 : i + 2] == "]" else 3 if text[i + 1 : i + 3] == "^]" else 1
            continue  # (a ] right after [ or [^ is a member, not the end)
        elif c == "(":
            depth += 1
            top = max(top, depth)
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1
    return top


def _ebnf_depth(text: str) -> int:
    """How deeply an EBNF grammar's groups nest (strings, character classes and comments skipped)."""
    depth = top = 0
    i, n, quote = 0, len(text), None
    while i < n:
        c = text[i]
        if quote is not None:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"[":
            quote = "]" if c == "[" else c
        elif c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c == "(":
            depth += 1
            top = max(top, depth)
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1
    return top
