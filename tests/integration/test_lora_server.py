"""Multi-LoRA on the real server (issue 34 item 4): ``--lora-paths``, the adapters as models of
``/v1/models`` (parent: the base), a request selecting one by ``model`` (OpenAI) or ``lora_path``
(native ``/generate``), ``/load_lora_adapter`` and ``/unload_lora_adapter`` under the admin key, and
their refusals in the OpenAI error shape (nothing allocated: the books are clean after every test).
fp32 greedy on the tiny chat model: each adapter answers what transformers + peft's merged model
answers."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.helpers import build_lora_adapter, hf_greedy, hf_model, peft_merged
from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Server

USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}
PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
N = 6
MLP_AND_O = ("o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def loras(chat_model, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("loras")
    return {
        "sql": build_lora_adapter(chat_model, str(d / "sql"), seed=11),
        "poem": build_lora_adapter(chat_model, str(d / "poem"), seed=12, r=2, targets=MLP_AND_O),
        "big": build_lora_adapter(chat_model, str(d / "big"), seed=13, r=16),
    }


@pytest.fixture(scope="module")
def want(chat_model, loras) -> dict:
    """Greedy continuations of PROMPT: the base model's and each adapter's merged model's."""
    models = {None: hf_model(chat_model), **{n: peft_merged(chat_model, p) for n, p in loras.items()}}
    return {n: hf_greedy(m, PROMPT, N) for n, m in models.items()}


@pytest.fixture(scope="module")
def lora_server(chat_model, loras, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "lora.log")
    args = ("--api-key", "user-key", "--admin-api-key", "admin-key", "--max-lora-rank", "8",
            "--lora-paths", f"sql={loras['sql']}")  # fmt: skip
    # Every forward at least 10 ms: a streamed request is still running when the unload arrives.
    s = Server(chat_model, *ENGINE_ARGS, *args, log_path=log, env={"KVLEDGER_TEST_STEP_DELAY_S": "0.01"})
    s.headers = ADMIN
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture
def ls(lora_server):
    restarts = lora_server.info()["engine_restarts"]
    yield lora_server
    info = lora_server.wait_idle_clean()
    assert info["engine_restarts"] == restarts, lora_server.logs()[-2000:]


def _generate(s, lora: str | None, **extra) -> httpx.Response:
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True},
            **({"lora_path": lora} if lora else {}), **extra}  # fmt: skip
    return httpx.post(s.url + "/generate", json=body, headers=USER, timeout=60)


def _admin(s, path: str, body: dict, headers=ADMIN) -> httpx.Response:
    return httpx.post(s.url + path, json=body, headers=headers, timeout=60)


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


def test_adapters_are_models_whose_parent_is_the_base(ls, loras):
    c = openai.OpenAI(base_url=ls.url + "/v1", api_key="user-key", max_retries=0)
    models = {m.id: m for m in c.models.list().data}
    base = next(iter(models))
    assert set(models) == {base, "sql"}
    # ``root`` names the model, never a path on the server's disk (issue 56).
    assert models["sql"].parent == base and models["sql"].root == "sql" and models[base].root == base
    assert loras["sql"] not in httpx.get(ls.url + "/v1/models", headers=USER).text
    assert c.models.retrieve("sql").id == "sql"


def test_each_request_runs_its_own_adapter(ls, want):
    """Native by ``lora_path``, OpenAI by ``model``: each equal to its merged model; a batch of
    /generate prompts may give one adapter per prompt (the base model for None)."""
    assert _generate(ls, None).json()["output_ids"] == want[None]
    native = _generate(ls, "sql").json()
    assert native["output_ids"] == want["sql"] != want[None]
    c = openai.OpenAI(base_url=ls.url + "/v1", api_key="user-key", max_retries=0)
    r = c.completions.create(model="sql", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
    assert r.model == "sql" and r.choices[0].text == native["text"]
    # Every OpenAI route answers with the model the request named (issue 56: the Responses API
    # named the base model), and runs that adapter.
    msgs = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(model="sql", messages=msgs, max_tokens=N, temperature=0)
    resp = c.responses.create(model="sql", input=msgs, max_output_tokens=N, temperature=0)
    base = c.responses.create(model="default", input=msgs, max_output_tokens=N, temperature=0)
    assert chat.model == resp.model == "sql" and base.model != "sql"
    assert resp.output_text == chat.choices[0].message.content
    body = {"input_ids": [PROMPT, PROMPT], "lora_path": ["sql", None],
            "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}}  # fmt: skip
    outs = httpx.post(ls.url + "/generate", json=body, headers=USER, timeout=60).json()
    assert [o["output_ids"] for o in outs] == [want["sql"], want[None]]


def test_load_use_and_unload(ls, loras, want):
    r = _admin(ls, "/load_lora_adapter", {"lora_name": "poem", "lora_path": loras["poem"]})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"sql": loras["sql"], "poem": loras["poem"]}
    c = openai.OpenAI(base_url=ls.url + "/v1", api_key="user-key", max_retries=0)
    assert "poem" in {m.id for m in c.models.list().data}
    assert _generate(ls, "poem").json()["output_ids"] == want["poem"]
    r = _admin(ls, "/unload_lora_adapter", {"lora_name": "poem"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"sql": loras["sql"]}
    _error(_generate(ls, "poem"), 404, "lora_not_found")
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="poem", prompt=PROMPT, max_tokens=2)


def test_bad_input_is_a_4xx_in_the_openai_shape(ls, loras, tmp_path):
    # rank 16 > --max-lora-rank 8
    _error(_admin(ls, "/load_lora_adapter", {"lora_name": "big", "lora_path": loras["big"]}), 400, "invalid_lora_adapter")
    _error(_admin(ls, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "no")}), 400)
    _error(_admin(ls, "/load_lora_adapter", {"lora_name": "sql", "lora_path": loras["poem"]}), 400, "lora_exists")
    _error(_admin(ls, "/load_lora_adapter", {"lora_name": "x"}), 400)  # no lora_path
    _error(_admin(ls, "/unload_lora_adapter", {"lora_name": "never"}), 404, "lora_not_found")
    _error(_admin(ls, "/load_lora_adapter", {"lora_name": "p", "lora_path": loras["poem"]}, USER), 403)
    _error(_generate(ls, "never"), 404, "lora_not_found")
    _error(_generate(ls, 7), 400)
    _error(_generate(ls, ["sql"], input_ids=[PROMPT, PROMPT]), 400)  # one adapter for two prompts
    r = httpx.post(ls.url + "/v1/chat/completions", headers=USER, timeout=30,
                   json={"model": "never", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    _error(r, 404, "model_not_found")
    assert [m["id"] for m in httpx.get(ls.url + "/v1/models", headers=USER).json()["data"]][1:] == ["sql"]


def test_unloading_an_adapter_while_its_request_runs_is_refused(ls, want, loras):
    """409 while a request of it streams; the request ends normally, then the unload succeeds (and
    the adapter is loaded again for the other tests)."""
    body = {"input_ids": PROMPT, "lora_path": "sql", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 150, "ignore_eos": True}}  # fmt: skip
    started, chunks = threading.Event(), []

    def stream():
        with httpx.stream("POST", ls.url + "/generate", json=body, headers=USER, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    _error(_admin(ls, "/unload_lora_adapter", {"lora_name": "sql"}), 409, "lora_busy")
    t.join(60)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["output_ids"][:N] == want["sql"]
    path = loras["sql"]
    assert _admin(ls, "/unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
    assert _admin(ls, "/load_lora_adapter", {"lora_name": "sql", "lora_path": path}).status_code == 200
