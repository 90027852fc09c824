"""Every JSON Schema keyword of draft 2020-12 through structured outputs: each is enforced (outputs
sampled at temperature 1 from a tiny random model, several seeds, validate with ``jsonschema``) or
refused with a 400 ``unsupported_schema`` naming it. The random model writes noisy JSON, so what
xgrammar lets through, it finds; the schemas keep their languages small enough to finish."""

from __future__ import annotations

import json

import jsonschema
import pytest
from jsonschema_specifications import REGISTRY

from kvledger import Engine, ValidationError
from tests.helpers import assert_idle_clean

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
AB = {"enum": ["a", "b"]}
NULL = {"type": "null"}
ANNOTATED = {"title": "T", "description": "d", "default": 1, "deprecated": False, "readOnly": True,
             "writeOnly": False, "examples": [1], "$comment": "c"}  # fmt: skip
PETS = {
    "$defs": {
        "Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": DIGIT},
                "required": ["kind", "lives"], "additionalProperties": False},
        "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                "required": ["kind", "good"], "additionalProperties": False},
    },
    "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
    "discriminator": {"propertyName": "kind"},
}  # fmt: skip

# (keyword, schema): the outputs must validate.
ENFORCED: list[tuple[str, dict]] = [
    ("$schema", {"$schema": "https://json-schema.org/draft/2020-12/schema", "enum": [1, 2]}),
    ("$id", {"$id": "https://example.com/digit", **DIGIT}),
    ("$anchor", {"$anchor": "top", **DIGIT}),
    ("$dynamicAnchor", {"$dynamicAnchor": "top", **DIGIT}),
    ("$vocabulary", {"$vocabulary": {"https://json-schema.org/draft/2020-12/vocab/core": True}, **DIGIT}),
    ("$ref", {"$defs": {"D": DIGIT}, "type": "array", "items": {"$ref": "#/$defs/D"}, "maxItems": 3}),
    ("$defs", {"$defs": {"P": {"type": "object", "properties": {"x": AB}, "required": ["x"]}},
               "type": "array", "items": {"$ref": "#/$defs/P"}, "minItems": 1, "maxItems": 2}),
    ("$comment", {"$comment": "a digit", **DIGIT}),
    ("prefixItems", {"type": "array", "prefixItems": [AB, {"type": "boolean"}], "items": False}),
    ("items", {"type": "array", "items": DIGIT, "minItems": 1, "maxItems": 4}),
    ("additionalProperties", {"type": "object", "properties": {"a": NULL}, "additionalProperties": False}),
    ("additionalProperties", {"type": "object", "additionalProperties": {"enum": [1, 2]},
                              "propertyNames": {"enum": ["a", "b", "c"]}, "maxProperties": 3}),
    ("properties", {"type": "object", "properties": {"a": {"type": "boolean"}, "b": AB}, "required": ["a"]}),
    ("patternProperties", {"type": "object", "patternProperties": {"^[a-c]$": {"type": "boolean"}},
                           "maxProperties": 3}),
    ("patternProperties", {"type": "object", "properties": {"xa": AB}, "required": ["xa"],
                           "patternProperties": {"^[b-c]{1,2}$": NULL}, "maxProperties": 3}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-c]{1,2}$"},
                       "additionalProperties": NULL, "maxProperties": 3}),
    ("allOf", {"allOf": [DIGIT]}),
    ("anyOf", {"anyOf": [DIGIT, {"type": "boolean"}, AB]}),
    ("oneOf", {"oneOf": [DIGIT, NULL, {"enum": ["x", "y"]}]}),
    ("oneOf", PETS),
    ("unevaluatedItems", {"type": "array", "prefixItems": [{"const": 1}], "unevaluatedItems": {"type": "boolean"},
                          "maxItems": 3}),
    ("unevaluatedProperties", {"type": "object", "propertyNames": {"enum": ["a", "b"]},
                               "unevaluatedProperties": {"enum": [5]}}),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": AB}, "unevaluatedProperties": False}),
    ("type", {"type": ["boolean", "null"]}),
    ("type", {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}, "i": DIGIT,
              "n": {"type": "number", "minimum": 0, "maximum": 1}, "b": {"type": "boolean"}, "z": NULL,
              "l": {"type": "array", "maxItems": 0}}, "required": ["s", "i", "n", "b", "z", "l"]}),
    ("const", {"const": {"a": [1, "x", None]}}),
    ("const", {"type": "string", "const": "x"}),
    ("enum", {"enum": [1, "two", None, [3], {"four": 4}]}),
    ("multipleOf", {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 70}),
    ("multipleOf", {"type": "integer", "multipleOf": 25, "minimum": -100, "maximum": 100}),
    ("maximum", {"type": "integer", "maximum": -3, "minimum": -9}),
    ("minimum", {"type": "number", "minimum": 2.5, "maximum": 3}),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1, "minimum": 0}),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 5, "maximum": 9}),
    ("maxLength", {"type": "string", "maxLength": 4}),
    ("minLength", {"type": ["string", "null"], "minLength": 2, "maxLength": 3}),
    ("pattern", {"type": "string", "pattern": "^[a-z]{2}-[0-9]{1,3}$"}),
    ("maxItems", {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}),
    ("minItems", {"type": "array", "items": NULL, "minItems": 2, "maxItems": 3}),
    ("uniqueItems", {"type": "array", "items": AB, "maxItems": 3, "uniqueItems": False}),
    ("maxProperties", {"type": "object", "properties": {"a": NULL, "b": NULL, "c": NULL}, "maxProperties": 1}),
    ("minProperties", {"type": "object", "properties": {"a": NULL, "b": NULL, "c": NULL}, "minProperties": 2}),
    ("required", {"type": "object", "properties": {"a": DIGIT, "b": AB}, "required": ["b"]}),
    *((k, {**ANNOTATED, **DIGIT}) for k in ("title", "description", "default", "deprecated", "readOnly",
                                            "writeOnly", "examples")),
    ("format", {"type": "string", "format": "uuid"}),
    ("format", {"type": "string", "format": "ipv6"}),
]  # fmt: skip

# (keyword, schema): refused, with the keyword named.
REFUSED: list[tuple[str, dict]] = [
    ("$id", {"type": "object", "properties": {"a": {"$id": "https://example.com/a", **DIGIT}}}),
    ("$dynamicRef", {"$dynamicAnchor": "n", "type": "array", "items": {"$dynamicRef": "#n"}}),
    ("$ref", {"$ref": "https://example.com/digit.json"}),
    ("maximum", {"$defs": {"D": DIGIT}, "$ref": "#/$defs/D", "maximum": 3}),
    ("contains", {"type": "array", "items": DIGIT, "contains": {"const": 7}, "maxItems": 4}),
    ("additionalProperties", {"type": "object", "properties": {"a": NULL}, "additionalProperties": {"type": "boolean"}}),
    ("patternProperties", {"type": "object", "patternProperties": {"^[ab]$": {"enum": [1, 2]}, "^[bc]$": {"enum": [2, 3]}}}),
    ("patternProperties", {"type": "object", "properties": {"xa": {"type": "boolean"}},
                           "patternProperties": {"^x": {"const": True}}}),
    ("dependentSchemas", {"type": "object", "properties": {"a": DIGIT}, "dependentSchemas": {"a": {"required": ["a"]}}}),
    ("propertyNames", {"type": "object", "properties": {"abc": NULL}, "propertyNames": {"maxLength": 2}}),
    ("if", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}, "else": {"maximum": 2}}),
    ("then", {"type": "integer", "then": {"maximum": 7}}),
    ("else", {"type": "integer", "else": {"maximum": 2}}),
    ("allOf", {"allOf": [DIGIT, {"type": "integer", "minimum": 5}]}),
    ("type", {"type": "object", "anyOf": [DIGIT, {"type": "boolean"}]}),
    ("oneOf", {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "integer", "minimum": 3}]}),
    ("not", {"type": "integer", "not": {"const": 3}}),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": NULL}, "unevaluatedProperties": {"const": 5}}),
    ("type", {"type": "string", "const": 5}),
    ("type", {"type": "string", "enum": ["a", 5]}),
    ("maxLength", {"type": "string", "enum": ["a", "bb"], "maxLength": 1}),
    ("multipleOf", {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 3}),
    ("multipleOf", {"type": "integer", "multipleOf": 7, "minimum": 0}),
    ("multipleOf", {"type": "integer", "multipleOf": 2000}),
    ("minimum", {"minimum": 3}),
    ("maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}),
    ("minLength", {"type": "string", "format": "date", "minLength": 12}),
    ("pattern", {"type": "string", "format": "uuid", "pattern": "^a+$"}),
    ("pattern", {"type": "string", "pattern": "(?!x)[a-z]"}),
    ("uniqueItems", {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "maxItems": 3}),
    ("maxContains", {"type": "array", "contains": {"const": 1}, "maxContains": 1}),
    ("minContains", {"type": "array", "contains": {"const": 1}, "minContains": 2}),
    ("minProperties", {"type": "object", "patternProperties": {"^[ab]$": {"const": 1}}, "minProperties": 2}),
    ("required", {"type": "object", "properties": {"a": DIGIT}, "required": ["a", "zzz"]}),
    ("required", {"required": ["a"]}),
    ("dependentRequired", {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "dependentRequired": {"a": ["b"]}}),
    ("format", {"type": "string", "format": "binary"}),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}),
    ("contentMediaType", {"type": "string", "contentMediaType": "application/json"}),
    ("contentSchema", {"type": "string", "contentMediaType": "application/json", "contentSchema": DIGIT}),
    ("nullable", {"type": "string", "maxLength": 3, "nullable": True}),  # not a JSON Schema keyword
    ("additionalItems", {"type": "array", "items": DIGIT, "additionalItems": False}),
]  # fmt: skip

SEEDS = range(4)


def test_every_keyword_of_draft_2020_12_is_enforced_or_refused():
    vocabulary = set()
    for uri in REGISTRY:
        if "/draft/2020-12/meta/" in uri:
            vocabulary |= set(REGISTRY.contents(uri).get("properties", {}))
    assert len(vocabulary) == 57
    assert vocabulary <= {k for k, _ in ENFORCED} | {k for k, _ in REFUSED}


@pytest.fixture(scope="module")
def eng(chat_model):
    from kvledger.model import load_model

    e = Engine(loaded_model=load_model(chat_model), dtype="float32", page_size=16, max_total_tokens=8192,
               max_running_requests=64, strict_memory=True)  # fmt: skip
    yield e
    assert_idle_clean(e)


def test_enforced_keywords_hold_on_sampled_outputs(eng):
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    broken = []
    for seed in SEEDS:  # one batch per seed: every schema beside the others
        outs = eng.generate(
            input_ids=[[5 + i] * (4 + seed) for i in range(len(ENFORCED))],
            sampling_params=[
                {"json_schema": json.dumps(schema), "temperature": 1.0, "seed": seed, "max_new_tokens": 128}
                for _, schema in ENFORCED
            ],
        )
        for (keyword, schema), out in zip(ENFORCED, outs):
            try:
                assert out["meta_info"]["finish_reason"]["type"] == "stop", "unfinished"
                value = json.loads(out["text"])  # strict: a raw control character in a string fails here
                jsonschema.Draft202012Validator(schema, format_checker=checker).validate(value)
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                # xgrammar 0.2.9 lets a string take byte sequences that are not UTF-8 (surrogates,
                # overlong forms), which a byte-level model can write; they decode to U+FFFD, so a
                # string can outgrow maxLength. A limitation of xgrammar's UTF-8 handling, not of a
                # keyword: such outputs are set aside (a real tokenizer rarely writes them).
                if "\ufffd" not in out["text"]:
                    broken.append((keyword, seed, out["text"], str(e).splitlines()[0]))
    assert not broken, "\n".join(map(repr, broken))


@pytest.mark.parametrize("keyword, schema", REFUSED, ids=[f"{k}-{i}" for i, (k, _) in enumerate(REFUSED)])
def test_keywords_that_are_not_enforced_are_refused_naming_them(eng, keyword, schema):
    before = eng.memory()
    with pytest.raises(ValidationError) as e:
        eng.generate(input_ids=[3, 4], sampling_params={"json_schema": json.dumps(schema), "max_new_tokens": 8})
    err = e.value
    assert err.status == 400 and err.code == "unsupported_schema" and err.param == "json_schema", err.message
    assert keyword in err.message, err.message
    assert eng.memory() == before
