"""Which JSON Schema keywords structured outputs enforce, decided from what xgrammar 0.2.9 does.

xgrammar compiles any schema it can parse, but it ignores many keywords (``contains``, ``not``,
``multipleOf`` on numbers, ``allOf`` with several schemas, a ``pattern`` beside ``format``...) and
enforces others only in part (a ``oneOf`` it cannot prove disjoint becomes an ``anyOf``; a listed
property can be written again under ``additionalProperties``). Output that breaks the schema would
follow. So a schema is checked against an allow-list before it is compiled: per schema type, the
keywords xgrammar enforces, and the conditions under which it enforces them (its converter reads a
node in a fixed order: ``$ref``, then ``const``, ``enum``, ``anyOf``, ``oneOf``, ``allOf``, then the
type's keywords; what it does not read beside the first is ignored). Anything else is refused,
naming the keyword and where it is. tests/engine/test_structured.py samples every keyword of draft
2020-12 on a random model: enforced ones validate with ``jsonschema``, the rest are refused.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..common import patterns
from .disjoint import COMBINATORS, branches_disjoint, is_type

# Describe, do not constrain: allowed anywhere (``$id`` only at the root, see below).
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment",
     "$schema", "$id", "$anchor", "$dynamicAnchor", "$vocabulary", "discriminator"}
)  # fmt: skip
DEFINITIONS = ("$defs", "definitions")  # containers of schemas reached by $ref
# The keywords xgrammar enforces for each type (with the conditions checked below).
BY_TYPE: dict[str, frozenset[str]] = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "array": frozenset({"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems"}),
    "object": frozenset(
        {"properties", "required", "patternProperties", "propertyNames", "additionalProperties",
         "unevaluatedProperties", "minProperties", "maxProperties"}
    ),
    "boolean": frozenset(),
    "null": frozenset(),
}
TYPED = frozenset().union(*BY_TYPE.values(), {"multipleOf"})
KNOWN = ANNOTATIONS | TYPED | {"$ref", "type", "enum", "const", *COMBINATORS, *DEFINITIONS}
# Keywords of draft 2020-12 (and earlier drafts) that xgrammar does not enforce, with the reason given.
NOT_ENFORCED = {
    "not": "xgrammar ignores it",
    "if": "xgrammar ignores conditionals",
    "then": "xgrammar ignores conditionals",
    "else": "xgrammar ignores conditionals",
    "dependentSchemas": "xgrammar ignores it",
    "dependentRequired": "xgrammar ignores it",
    "dependencies": "xgrammar ignores it",
    "contains": "xgrammar does not check what an array contains",
    "minContains": "xgrammar does not check what an array contains",
    "maxContains": "xgrammar does not check what an array contains",
    "additionalItems": "a draft-7 keyword xgrammar ignores (use prefixItems and items)",
    "contentEncoding": "xgrammar does not check string contents",
    "contentMediaType": "xgrammar does not check string contents",
    "contentSchema": "xgrammar does not check string contents",
    "$dynamicRef": "xgrammar does not follow dynamic references",
}
# The string formats xgrammar turns into a pattern (their shape: a date's day is not checked against
# its month, an IPv4 part may have leading zeros); any other format is ignored by xgrammar.
FORMATS = frozenset(
    {"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
)  # fmt: skip
_OBJECT_CUES = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_CUES = ("items", "prefixItems", "unevaluatedItems")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def unsupported_keywords(schema: Any) -> list[str]:
    """What in ``schema`` structured outputs cannot enforce: one line per keyword, naming it, where
    it is (a JSON pointer) and why. Empty when every keyword is enforced. A schema that is not valid
    is left to the compiler, which says why."""
    check = _Check(schema)
    check.node(schema, "#")
    return check.problems


class _Check:
    def __init__(self, root: Any):
        self.root = root
        self.problems: list[str] = []

    def bad(self, path: str, keyword: str, why: str) -> None:
        line = f"{keyword} at {path}: {why}"
        if line not in self.problems:
            self.problems.append(line)

    # -- one schema node, read in xgrammar's order ---------------------------------------------
    def node(self, s: Any, path: str, default_type: str | None = None) -> None:
        if not isinstance(s, dict):
            return  # true, false or not a schema: the compiler decides
        for k in s:
            if k not in KNOWN and not k.startswith("x-"):
                self.bad(path, k, NOT_ENFORCED.get(k, "not a keyword structured outputs enforce"))
        if "$id" in s and path != "#":
            self.bad(path, "$id", "an embedded $id changes what $ref means; xgrammar ignores it")
        for d in DEFINITIONS:
            if isinstance(s.get(d), dict):
                for name, sub in s[d].items():
                    self.node(sub, f"{path}/{d}/{name}")
        if "$ref" in s:
            self.siblings(s, path, "$ref")
            ref = s["$ref"]
            if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
                self.bad(path, "$ref", f"{ref!r}: only references inside the schema (#/...) are followed")
            return
        for kw in ("const", "enum"):
            if kw in s:
                self.values(s, path, kw)
                return
        for kw in COMBINATORS:
            if kw in s:
                self.combinator(s, path, kw)
                return
        types = self.types(s, default_type)
        if types is None:  # xgrammar generates any JSON value here
            for k in s:
                if k in TYPED:
                    self.bad(path, k, 'needs a "type" (without one, xgrammar allows any value here)')
            return
        for t in types:
            getattr(self, "_" + t)(s, path)

    def types(self, s: dict, default_type: str | None) -> list[str] | None:
        t = s.get("type")
        if isinstance(t, str):
            return [t] if t in BY_TYPE else []  # an unknown type: the compiler refuses it
        if isinstance(t, list) and t:
            return [x for x in t if isinstance(x, str) and x in BY_TYPE]
        if default_type is not None:
            return [default_type]
        if any(k in s for k in _OBJECT_CUES):
            return ["object"]
        if any(k in s for k in _ARRAY_CUES):
            return ["array"]
        return None

    def siblings(self, s: dict, path: str, kw: str, also: tuple[str, ...] = ()) -> None:
        """Keywords beside ``kw`` that xgrammar does not read once it has read ``kw``."""
        for k in s:
            if k != kw and k in KNOWN and k not in ANNOTATIONS and k not in DEFINITIONS and k not in also:
                self.bad(path, k, f"beside {kw}, xgrammar follows only {kw}")

    def values(self, s: dict, path: str, kw: str) -> None:
        self.siblings(s, path, kw, also=("type",))
        values = [s[kw]] if kw == "const" else s[kw]
        t = s.get("type")
        types = [t] if isinstance(t, str) else t
        if not isinstance(values, list) or not isinstance(types, list):
            return
        for v in values:
            if not any(is_type(v, x) for x in types):
                self.bad(path, "type", f"the {kw} value {json.dumps(v)} is not of this type")

    def combinator(self, s: dict, path: str, kw: str) -> None:
        self.siblings(s, path, kw)
        branches = s[kw]
        if not isinstance(branches, list):
            return
        if kw == "allOf" and len(branches) > 1:
            self.bad(path, "allOf", "with several schemas, xgrammar enforces none of them")
            return
        if kw == "oneOf" and not branches_disjoint(self.root, branches):
            self.bad(
                path,
                "oneOf",
                "branches that may overlap are enforced as anyOf (make them differ by type, const/enum "
                "or a required property with const values, or use anyOf)",
            )
        for i, b in enumerate(branches):
            self.node(b, f"{path}/{kw}/{i}")

    # -- each type's keywords --------------------------------------------------------------------
    def _string(self, s: dict, path: str) -> None:
        fmt, pattern = s.get("format"), s.get("pattern")
        if isinstance(fmt, str) and fmt not in FORMATS:
            self.bad(path, "format", f"{fmt!r} is not checked (xgrammar checks {', '.join(sorted(FORMATS))})")
        if fmt is not None and pattern is not None:
            self.bad(path, "pattern", "beside format, xgrammar follows only the format")
        for k in ("minLength", "maxLength"):
            if k in s and (fmt is not None or pattern is not None):
                self.bad(path, k, f"beside {'format' if fmt is not None else 'pattern'}, xgrammar ignores it")
        if isinstance(pattern, str) and ("(?=" in pattern or "(?!" in pattern):
            self.bad(path, "pattern", "xgrammar ignores lookahead assertions")

    def _integer(self, s: dict, path: str) -> None:
        if "multipleOf" in s and not _multiple_of_enforced(s):
            self.bad(
                path,
                "multipleOf",
                "xgrammar enforces it for a whole number up to 1024, with no bounds or with both a "
                "lower and an upper bound at most 10000 apart",
            )

    def _number(self, s: dict, path: str) -> None:
        if "multipleOf" in s:
            self.bad(path, "multipleOf", 'xgrammar ignores it for "number" (it enforces it for "integer")')

    def _boolean(self, s: dict, path: str) -> None:
        pass

    def _null(self, s: dict, path: str) -> None:
        pass

    def _array(self, s: dict, path: str) -> None:
        if s.get("uniqueItems") not in (None, False):
            self.bad(path, "uniqueItems", "xgrammar does not keep items distinct")
        if isinstance(s.get("prefixItems"), list):
            for i, sub in enumerate(s["prefixItems"]):
                self.node(sub, f"{path}/prefixItems/{i}")
        if "items" in s:
            self.node(s["items"], f"{path}/items")
        elif "unevaluatedItems" in s:  # beside items it evaluates nothing
            self.node(s["unevaluatedItems"], f"{path}/unevaluatedItems")

    def _object(self, s: dict, path: str) -> None:
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        patterns = s.get("patternProperties") if isinstance(s.get("patternProperties"), dict) else {}
        required = s.get("required") if isinstance(s.get("required"), list) else []
        for name in required:
            if isinstance(name, str) and name not in props:
                self.bad(path, "required", f"{name!r} is not in properties, and xgrammar writes only those")
        # additionalProperties evaluates every other property, so unevaluatedProperties beside it is moot.
        free = "additionalProperties" if "additionalProperties" in s else "unevaluatedProperties"
        extra = s.get(free, False)
        if props and extra is not False:
            self.bad(path, free, "beside properties, xgrammar may write a listed property again under it")
        if len(patterns) > 1:
            self.bad(path, "patternProperties", "with several patterns, a name may match more than one")
        for pat in patterns:
            for name in props:
                if _search(pat, name) is not False:
                    self.bad(path, "patternProperties", f"{pat!r} may match the listed property {name!r}")
        if "propertyNames" in s and (props or patterns):
            self.bad(path, "propertyNames", "beside properties or patternProperties, xgrammar ignores it")
        names_free = bool(patterns) or "propertyNames" in s or extra is not False
        if names_free and s.get("minProperties", 0) not in (0, None):
            self.bad(path, "minProperties", "xgrammar may repeat a property name, and a repeat does not count")
        for name, sub in props.items():
            self.node(sub, f"{path}/properties/{name}")
        for pat, sub in patterns.items():
            self.node(sub, f"{path}/patternProperties/{pat}")
        if isinstance(extra, dict):
            self.node(extra, f"{path}/{free}")
        if "propertyNames" in s:
            self.node(s["propertyNames"], f"{path}/propertyNames", default_type="string")


def _search(pattern: str, name: str) -> bool | None:
    """Whether ``pattern`` matches ``name`` somewhere (JSON Schema's regex semantics); None if RE2
    cannot read the pattern. Both come from the client: RE2 (linear time), never a backtracking
    ``re`` that a pattern such as ``(a+a+)+b`` against a long name would stall."""
    return patterns.search(pattern, name)


def _multiple_of_enforced(s: dict) -> bool:
    """When xgrammar 0.2.9 builds an integer ``multipleOf`` (json_schema_converter.cc, ParseInteger):
    a whole number in (0, 1024], with no bounds or with a lower and an upper bound at most 10000
    integers apart. Otherwise it logs a warning and drops it."""
    m = s["multipleOf"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0:
        return True  # not a valid schema: the compiler says why
    if not float(m).is_integer() or m > 1024:
        return False
    bounds = {k: s[k] for k in _BOUNDS if isinstance(s.get(k), (int, float)) and not isinstance(s[k], bool)}
    if not bounds:
        return True
    lows = [math.ceil(bounds["minimum"])] if "minimum" in bounds else []
    lows += [math.floor(bounds["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in bounds else []
    highs = [math.floor(bounds["maximum"])] if "maximum" in bounds else []
    highs += [math.ceil(bounds["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in bounds else []
    return bool(lows and highs) and min(highs) - max(lows) + 1 <= 10000
