"""Reasoning output through the real server and openai-python (``--reasoning-parser``), on the
scripted reasoning model (it writes ``<think>Why</think>OK``): ``reasoning_content`` whole and
streamed (``stream_reasoning`` false: in one delta), ``separate_reasoning`` false, Qwen3's
``enable_thinking: false``, DeepSeek-R1's template-opened reasoning, structured output and tool calls
after the reasoning (their grammar starts at ``</think>``), the parser shown by ``/v1/models`` and
``/get_server_info``; wrong types are 400s in OpenAI's shape; an unknown parser name stops the CLI
with exit 2. Books clean after each test."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from tests.integration.conftest import started_server

ASK = [{"role": "user", "content": "Why?"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
UNIT = {
    "type": "function",
    "function": {"name": "set_unit", "description": "Set the unit",
                 "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}},
}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_server(reasoning_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "reasoning.log")
    yield from started_server(reasoning_model, log, "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def r1_server(deepseek_r1_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "r1.log")
    yield from started_server(deepseek_r1_model, log, "--reasoning-parser", "deepseek-r1")


@pytest.fixture
def qsrv(qwen3_server):
    yield qwen3_server
    qwen3_server.wait_idle_clean()


@pytest.fixture
def rsrv(r1_server):
    yield r1_server
    r1_server.wait_idle_clean()


def oai(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def chat(s, **kw):
    kw.setdefault("max_tokens", 40)
    return oai(s).chat.completions.create(model="default", messages=ASK, temperature=0, **kw)


def streamed(s, **kw) -> tuple[list[tuple[str, str]], dict]:
    """The stream's deltas in order, as ("reasoning" | "content", text), and the calls by index."""
    parts, calls = [], {}
    kw.setdefault("max_tokens", 40)
    for ch in oai(s).chat.completions.create(model="default", messages=ASK, temperature=0, stream=True, **kw):
        for c in ch.choices:
            d = c.delta
            r = (d.model_extra or {}).get("reasoning_content")
            if r:
                parts.append(("reasoning", r))
            if d.content:
                parts.append(("content", d.content))
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return parts, calls


def joined(parts, kind: str) -> str:
    return "".join(t for k, t in parts if k == kind)


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_reasoning_content_whole_and_streamed(qsrv):
    m = chat(qsrv).choices[0].message
    assert (reasoning_of(m), m.content) == ("Why", "OK")
    parts, _ = streamed(qsrv)
    assert joined(parts, "reasoning") == "Why" and joined(parts, "content") == "OK"
    assert [k for k, _ in parts] == sorted((k for k, _ in parts), reverse=True)  # reasoning first, then content
    assert len([k for k, _ in parts if k == "reasoning"]) == 3  # streamed as it comes: one token a delta
    whole, _ = streamed(qsrv, extra_body={"stream_reasoning": False})
    assert [p for p in whole if p[0] == "reasoning"] == [("reasoning", "Why")]  # one delta, once complete
    assert joined(whole, "content") == "OK"


def test_separate_reasoning_false_and_thinking_off(qsrv):
    m = chat(qsrv, extra_body={"separate_reasoning": False}).choices[0].message
    assert (reasoning_of(m), m.content) == (None, "<think>Why</think>OK")  # as without a parser
    parts, _ = streamed(qsrv, extra_body={"separate_reasoning": False})
    assert parts and all(k == "content" for k, _ in parts) and joined(parts, "content") == "<think>Why</think>OK"
    # Qwen3's template writes an empty reasoning block itself: the model answers at once.
    m = chat(qsrv, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (reasoning_of(m), m.content) == (None, "OK")


def test_n_choices_each_split(qsrv):
    r = chat(qsrv, n=2)
    assert [(reasoning_of(c.message), c.message.content) for c in r.choices] == [("Why", "OK")] * 2
    parts, _ = streamed(qsrv, n=2)
    assert joined(parts, "reasoning") == "WhyWhy" or sorted(joined(parts, "reasoning")) == sorted("WhyWhy")


def test_structured_output_applies_to_the_answer(qsrv):
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    m = chat(qsrv, response_format=rf).choices[0].message
    assert reasoning_of(m) == "Why" and json.loads(m.content) == {"ok": False}
    parts, _ = streamed(qsrv, response_format=rf)
    assert joined(parts, "reasoning") == "Why" and json.loads(joined(parts, "content")) == {"ok": False}
    # Thinking off: no reasoning to wait for, the grammar holds from the first token.
    off = chat(qsrv, response_format=rf, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_of(off.choices[0].message) is None and json.loads(off.choices[0].message.content) == {"ok": False}


def test_tool_calls_after_the_reasoning_parse(qsrv):
    kw = dict(tools=[UNIT], tool_choice="required", parallel_tool_calls=False, max_tokens=120)  # bytes
    c = chat(qsrv, **kw).choices[0]
    assert c.finish_reason == "tool_calls" and reasoning_of(c.message) == "Why"
    [call] = c.message.tool_calls
    assert call.function.name == "set_unit" and json.loads(call.function.arguments) in ({"unit": "c"}, {"unit": "f"})
    parts, calls = streamed(qsrv, **kw)
    assert joined(parts, "reasoning") == "Why" and not joined(parts, "content").strip()
    assert [v["name"] for v in calls.values()] == ["set_unit"]
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_responses_give_a_reasoning_item_first(qsrv):
    c = oai(qsrv)
    r = c.responses.create(model="default", input="Why?", temperature=0, max_output_tokens=40)
    assert [it.type for it in r.output] == ["reasoning", "message"] and r.output_text == "OK"
    assert [(p.type, p.text) for p in r.output[0].content] == [("reasoning_text", "Why")] and r.output[0].summary == []
    with c.responses.stream(model="default", input="Why?", temperature=0, max_output_tokens=40) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    deltas = [k for k in kinds if k.endswith(".delta")]
    assert deltas == ["response.reasoning_text.delta"] * 3 + ["response.output_text.delta"] * 2
    assert [it.type for it in final.output] == ["reasoning", "message"] and final.output_text == "OK"
    # The next turn continues from it (its conversation keeps the reasoning as reasoning_content).
    nxt = c.responses.create(model="default", input="And?", previous_response_id=r.id, temperature=0, max_output_tokens=40)
    assert nxt.output_text == "OK"
    # ... and so does a client that sends the items back itself (the reasoning item among them).
    items = [{"role": "user", "content": "Why?"}, *(it.model_dump(exclude_none=True) for it in r.output),
             {"role": "user", "content": "And?"}]  # fmt: skip
    again = c.responses.create(model="default", input=items, temperature=0, max_output_tokens=40)
    assert again.output_text == "OK" and again.usage.input_tokens == nxt.usage.input_tokens


def test_generate_takes_require_reasoning(qsrv):
    ids = httpx.post(qsrv.url + "/tokenize", json={"messages": ASK}).json()["tokens"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(SCHEMA)}}
    free = httpx.post(qsrv.url + "/generate", json={**body, "require_reasoning": True}).json()
    assert free["text"] == '<think>Why</think>{"ok": false}', free
    bound = httpx.post(qsrv.url + "/generate", json=body).json()
    assert bound["text"] == '{"ok": false}', bound


@pytest.mark.parametrize(
    "field,value", [("separate_reasoning", "yes"), ("stream_reasoning", 1), ("stream_reasoning", [True])]
)
def test_wrong_types_are_400(qsrv, field, value):
    r = httpx.post(qsrv.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and field in (err["param"] or "") + err["message"]
    r = httpx.post(qsrv.url + "/generate", json={"text": "hi", "require_reasoning": "yes"})
    assert r.status_code == 400 and "require_reasoning" in r.text


def test_the_parser_is_shown(qsrv):
    card = oai(qsrv).models.list().data[0].model_extra
    assert card["reasoning_parser"] == "qwen3" and card["pooling"] == "last" and card["tool_call_parser"] == "hermes"
    assert card["priority_scheduling"] is False
    info = httpx.get(qsrv.url + "/get_server_info").json()
    assert info["reasoning_parser"] == "qwen3" and info["engine_config"]["reasoning_parser"] == "qwen3"


def test_deepseek_r1_reasoning_begins_in_the_template(rsrv):
    m = chat(rsrv).choices[0].message
    assert (reasoning_of(m), m.content) == ("Why", "OK")
    parts, _ = streamed(rsrv)
    assert joined(parts, "reasoning") == "Why" and joined(parts, "content") == "OK"
    # No toggle: enable_thinking: false does not stop an R1 model reasoning.
    m = chat(rsrv, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert reasoning_of(m) == "Why"


def test_without_a_parser_require_reasoning_is_refused(srv):
    r = httpx.post(srv.url + "/generate", json={"text": "hi", "require_reasoning": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "require_reasoning"


def test_an_unknown_parser_name_is_exit_2_naming_the_allowed_ones():
    p = subprocess.run(
        [sys.executable, "-m", "kvledger", "serve", "--reasoning-parser", "deepseek"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "--reasoning-parser" in p.stderr and "deepseek-r1" in p.stderr and "qwen3" in p.stderr
