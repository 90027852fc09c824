"""The grammar of a JSON schema, wherever a schema enters (``response_format``, ``json_schema``, a
tool's ``parameters``): bounded, refused where a keyword is not enforced (``keywords.py``), compiled
by xgrammar compact and in strict mode (``json_schema_grammar``); and xgrammar's error messages as a
400 shows them (``compile_reason``)."""

from __future__ import annotations

import json

from ..common.grammar_bounds import MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_LEN, check_grammar_bounds, grammar_too_deep
from ..errors import ValidationError
from .keywords import unsupported_keywords

# JSON is generated compactly (xgrammar's any_whitespace=False): small models given free whitespace
# tend to emit it until max_new_tokens, and the output is the same JSON either way. Schemas compile
# in strict mode (an object's unlisted properties are not generated), as OpenAI's strict mode asks.

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
            f"{what} does not compile: {compile_reason(e)}", param=param, code="invalid_grammar"
        ) from None


def compile_reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ": " in text and ".cc:" in text.split(": ", 1)[0]:
        text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(e).__name__
