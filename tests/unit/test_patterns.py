"""Client patterns (issue 50, item 1): stop_regex on RE2 (features it lacks refused naming them, a
backtracking pattern matched in linear time), grammars bounded in size and nesting before anything
parses them, a schema's patternProperties checked without backtracking."""

from __future__ import annotations

import json

import pytest

from kvledger import ValidationError
from kvledger.common import Limits, validate_sampling
from kvledger.common.patterns import compile_pattern
from kvledger.constrained.json_schema import json_schema_grammar
from kvledger.constrained.keywords import unsupported_keywords
from kvledger.scheduler import Req
from kvledger.scheduler.stop import StopChecker

LIMITS = Limits(vocab_size=256, context_length=100, max_grammar_len=1000, max_grammar_depth=8)


@pytest.mark.parametrize(
    "pattern, feature",
    [
        (r"(?=a)", "lookahead"),
        (r"(?!a)", "negative lookahead"),
        (r"(?<=a)b", "lookbehind"),
        (r"(?<!a)b", "negative lookbehind"),
        (r"(a)\1", "backreference \\1"),
        (r"(?P<x>a)(?P=x)", "named backreference"),
        (r"(?<n>a)\k<n>", "named backreference"),
        (r"a++", "possessive quantifier"),
        (r"a*+", "possessive quantifier"),
        (r"(?>a)", "atomic group"),
        (r"(?(1)a|b)", "conditional"),
        (r"a\Z", "\\z"),
        (r"a{1001}", "above 1000"),
    ],
)
def test_features_re2_lacks_are_refused_naming_them(pattern, feature):
    with pytest.raises(ValidationError) as e:
        validate_sampling({"stop_regex": pattern}, LIMITS)
    err = e.value
    assert err.status == 400 and err.param == "stop_regex" and err.code == "unsupported_regex", err.message
    assert feature in err.message, err.message


def test_malformed_patterns_are_400s_and_re2_syntax_is_taken():
    with pytest.raises(ValidationError) as e:
        validate_sampling({"stop_regex": ["ok", "((("]}, LIMITS)
    assert e.value.param == "stop_regex" and e.value.code == "invalid_regex"
    p = validate_sampling({"stop_regex": [r"\bor\b", r"(?i)END", r"[[:digit:]]{2}", r"(?P<n>x)"]}, LIMITS)
    assert len(p.stop_regex) == 4


def test_a_backtracking_pattern_is_matched_in_linear_time():
    """(x+x+)+y against 40 x's is ~2^40 steps for a backtracking matcher (the test would hang);
    RE2 answers at once, for a window far longer than any stop check decodes."""
    rx = compile_pattern("(x+x+)+y", "stop_regex")
    assert rx.search("x" * 100_000) is None
    assert rx.search("x" * 1000 + "y").group(0) == "x" * 1000 + "y"
    assert compile_pattern("(x+x+)+y", "stop_regex") is rx  # compiled once, from the cache after


def test_the_stop_check_uses_the_compiled_patterns_over_a_bounded_window():
    decoded: list[int] = []

    def decode(ids: list[int]) -> str:
        decoded.append(len(ids))
        return "x" * len(ids)

    stop = StopChecker([0], 10_000, decode)
    req = Req("r", [1], validate_sampling({"stop_regex": "(x+x+)+y", "max_new_tokens": 5000}, LIMITS))
    for _ in range(300):
        assert stop.append(req, [7], [None], [None]) == 1 and req.to_finish is None
    assert max(decoded) == 64  # REGEX_TAIL_TOKENS: never the whole output
    assert req.stop_patterns == [compile_pattern("(x+x+)+y", "stop_regex")]
    req.params.stop_regex = ["x{3}$"]
    req.stop_patterns = None
    stop.append(req, [7], [None], [None])
    assert req.to_finish is not None and req.to_finish.matched_text == "xxx"


def _nested(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


@pytest.mark.parametrize(
    "kind, value, code",
    [
        ("json_schema", json.dumps(_nested(8)), "grammar_too_deep"),  # 9 levels of objects
        ("json_schema", _nested(8), "grammar_too_deep"),  # (an object, as /generate takes it)
        ("json_schema", _nested(5000), "grammar_too_deep"),  # deeper than json.dumps goes
        ("json_schema", "[" * 100_000 + "]" * 100_000, "grammar_too_large"),
        ("json_schema", json.dumps({"enum": ["a" * 2000]}), "grammar_too_large"),
        ("regex", "(" * 9 + "a" + ")" * 9, "grammar_too_deep"),
        ("regex", "a" * 1001, "grammar_too_large"),
        ("ebnf", "root ::= " + "(" * 9 + '"a"' + ")" * 9, "grammar_too_deep"),
        ("ebnf", 'root ::= "' + "a" * 1000 + '"', "grammar_too_large"),
    ],
)
def test_grammars_past_the_bounds_are_refused_naming_the_limit(kind, value, code):
    with pytest.raises(ValidationError) as e:
        validate_sampling({kind: value}, LIMITS)
    err = e.value
    assert err.status == 400 and err.param == kind and err.code == code, err.message
    assert ("--max-grammar-depth" if code == "grammar_too_deep" else "--max-grammar-len") in err.message


def test_nesting_is_counted_as_the_grammar_reads_it():
    """Brackets inside strings, classes and escapes are not groups: at the limit, still taken."""
    ok = {
        "regex": r"[(((((((((]\(\(\(\(\(\(\(\(\((" + "(" * 7 + "a" + ")" * 8,
        "ebnf": 'root ::= "(((((((((((" [(((((((((((] # ((((((((((\n' + "(" * 8 + '"a"' + ")" * 8,
        "json_schema": json.dumps(_nested(7)),
    }
    for kind, v in ok.items():
        assert getattr(validate_sampling({kind: v}, LIMITS), kind) == v


def test_a_tool_schema_past_the_bounds_names_the_tool():
    with pytest.raises(ValidationError) as e:
        json_schema_grammar(_nested(40), "tools.0.function.parameters", "tools[0] (f): parameters")
    assert e.value.param == "tools.0.function.parameters" and e.value.code == "grammar_too_deep"
    assert "tools[0] (f)" in e.value.message


def test_pattern_properties_are_checked_without_backtracking():
    """A patternProperties pattern is tried on the listed property names (both the client's): with
    Python's re, (a+a+)+b against a 40-character name would hang the check."""
    schema = {
        "type": "object",
        "properties": {"a" * 40: {"type": "string"}},
        "patternProperties": {"(a+a+)+b": {"type": "string"}},
    }
    assert unsupported_keywords(schema) == []
    schema["patternProperties"] = {"^a+$": {"type": "string"}}
    assert any("patternProperties" in b for b in unsupported_keywords(schema))
