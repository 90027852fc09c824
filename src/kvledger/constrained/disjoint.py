"""Whether a ``oneOf``'s branches are provably disjoint (no value matches two of them): xgrammar
enforces a ``oneOf`` it cannot prove so as an ``anyOf``, so ``keywords.py`` refuses it. Branches are
disjoint by their const/enum values, by type, or, for objects, by one required property whose
const/enum values differ. ``is_type`` is JSON Schema's type test (``keywords.py`` checks const/enum
values against their ``type`` with it)."""

from __future__ import annotations

import json
from typing import Any

COMBINATORS = ("anyOf", "oneOf", "allOf")


def branches_disjoint(root: Any, branches: list) -> bool:
    """No value matches two of ``branches`` (a ``oneOf``'s, ``$ref`` followed inside ``root``)."""
    kinds = [branch_kind(resolve(root, b)) for b in branches]
    if any(k is None for k in kinds):
        return False
    return all(
        _kinds_disjoint(kinds[i], kinds[j])
        for i in range(len(kinds))
        for j in range(i + 1, len(kinds))
    )


def resolve(root: Any, s: Any, depth: int = 0) -> Any:
    """``s`` with its ``$ref`` followed (inside the document ``root`` only)."""
    while isinstance(s, dict) and isinstance(s.get("$ref"), str) and depth < 32:
        ref, s, depth = s["$ref"], root, depth + 1
        if ref != "#":
            if not ref.startswith("#/"):
                return None
            for part in ref[2:].split("/"):
                s = s.get(part) if isinstance(s, dict) else None
    return s


def branch_kind(s: Any) -> tuple | None:
    """What decides a branch's values: ("values", [...]) or ("types", {...}, object schema)."""
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return ("values", [s["const"]])
    if isinstance(s.get("enum"), list):
        return ("values", s["enum"])
    if any(k in s for k in ("$ref", *COMBINATORS)):
        return None
    t = s.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else None
    if not types:
        return None
    return ("types", types, s)


def _kinds_disjoint(a: tuple, b: tuple) -> bool:
    if a[0] == "values" and b[0] == "values":
        keys = {_value_key(v) for v in a[1]}
        return not any(_value_key(v) in keys for v in b[1])
    if a[0] == "values" or b[0] == "values":
        values, types = (a[1], b[1]) if a[0] == "values" else (b[1], a[1])
        return not any(is_type(v, t) for v in values for t in types)
    if not any(_types_overlap(x, y) for x in a[1] for y in b[1]):
        return True
    return a[1] == b[1] == {"object"} and _discriminated(a[2], b[2])


def _discriminated(a: dict, b: dict) -> bool:
    """Two object schemas that require one property with const/enum values that differ."""

    def finite(s: dict, name: str) -> list | None:
        props, required = s.get("properties"), s.get("required")
        p = props.get(name) if isinstance(props, dict) else None
        if not isinstance(p, dict) or not isinstance(required, list) or name not in required:
            return None
        if "const" in p:
            return [p["const"]]
        return p.get("enum") if isinstance(p.get("enum"), list) else None

    for name in a["properties"] if isinstance(a.get("properties"), dict) else ():
        va, vb = finite(a, name), finite(b, name)
        if va is not None and vb is not None and not {_value_key(v) for v in va} & {_value_key(v) for v in vb}:
            return True
    return False


def _types_overlap(x: str, y: str) -> bool:
    return x == y or {x, y} == {"integer", "number"}


def is_type(v: Any, t: str) -> bool:
    if t == "null":
        return v is None
    if t == "boolean":
        return isinstance(v, bool)
    if t == "string":
        return isinstance(v, str)
    if t == "array":
        return isinstance(v, list)
    if t == "object":
        return isinstance(v, dict)
    is_num = isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "integer":
        return is_num and float(v).is_integer()
    return is_num and t == "number"


def _value_key(v: Any) -> str:
    """JSON equality (1 == 1.0, true != 1)."""
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return f"n{float(v)!r}"
    return json.dumps(v, sort_keys=True)

