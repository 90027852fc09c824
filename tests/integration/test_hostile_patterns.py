"""Client patterns that would stall the engine (issue 50, item 1), through the real server on the tiny
chat model: a backtracking stop_regex ends in bounded time beside a bystander, patterns RE2 cannot
match in linear time and grammars past the bounds are 400s that hold nothing; no engine restart and
the books balanced after each (the ``srv`` fixture)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

# Greedy on the tiny chat model, this prompt under regex x+ writes x until max_new_tokens.
XS = [120, 120, 120]


def test_a_backtracking_stop_regex_stalls_no_one(srv):
    """The issue's target: with Python's re the stop check of (x+x+)+y over the last 64 x's
    backtracks for minutes on the engine's thread (every stream stops, the watchdog restarts the
    engine). With RE2 the request ends at max_new_tokens, and a bystander sent 2 s later answers."""
    body = {
        "input_ids": XS,
        "sampling_params": {"regex": "x+", "stop_regex": "(x+x+)+y", "temperature": 0, "max_new_tokens": 128},
    }
    bystander = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=20) as c:
            t0 = time.monotonic()
            hostile = asyncio.create_task(c.post("/generate", json=body))
            await asyncio.sleep(2)
            other = await c.post("/generate", json=bystander)
            return await hostile, other, time.monotonic() - t0

    hostile, other, _ = asyncio.run(main())  # (a stall shows as httpx's 20 s timeout)
    assert hostile.status_code == 200, hostile.text
    out = hostile.json()
    assert out["text"] == "x" * 128 and out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
    assert other.status_code == 200 and len(other.json()["output_ids"]) == 8, other.text
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize(
    "pattern, feature",
    [
        (r"(?=x)x", "lookahead"),
        (r"(?<!a)b", "negative lookbehind"),
        (r"(a)\1", "backreference"),
        (r"a++b", "possessive"),
        (r"(?>ab)", "atomic group"),
    ],
)
def test_stop_regex_features_re2_lacks_are_400s_naming_them(srv, pattern, feature):
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"model": "default", "prompt": "hi", "max_tokens": 4, "stop_regex": pattern},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == "stop_regex" and err["code"] == "unsupported_regex", err
    assert feature in err["message"], err


def _nested_arrays(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


@pytest.mark.parametrize(
    "extra, param, code",
    [
        ({"json_schema": json.dumps(_nested_arrays(200))}, "json_schema", "grammar_too_deep"),
        ({"regex": "(" * 100 + "a" + ")" * 100}, "regex", "grammar_too_deep"),
        ({"ebnf": 'root ::= "' + "a" * 70000 + '"'}, "ebnf", "grammar_too_large"),
    ],
)
def test_grammars_past_the_bounds_are_400s(srv, extra, param, code):
    r = httpx.post(
        srv.url + "/generate",
        json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, **extra}},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    assert "--max-grammar" in err["message"], err


def test_a_tool_schema_past_the_bounds_is_a_400_naming_the_tool(srv):
    tools = [{"type": "function", "function": {"name": "deep", "parameters": _nested_arrays(100)}}]
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
              "tool_choice": "required", "max_tokens": 4},
        timeout=30,
    )  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools.0.function.parameters" and err["code"] == "grammar_too_deep", err
