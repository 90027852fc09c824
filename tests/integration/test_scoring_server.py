"""Scoring over HTTP on the tiny chat model (fp32): /v1/completions echo + logprobs + max_tokens 0,
SGLang's return_logprob with logprob_start_len, equal to a full transformers forward with and
without a cached prefix; bad values are 400s."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.helpers import hf_model

TOL = 1e-4


@pytest.fixture(scope="module")
def chat_hf(chat_model):
    return hf_model(chat_model)


@torch.no_grad()
def reference(model, ids: list[int]) -> list[float]:
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and torch.allclose(torch.tensor(a), torch.tensor(b), atol=TOL)


def tokenize(srv, text: str) -> list[int]:
    return httpx.post(srv.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_echo_logprobs_score_the_prompt_with_and_without_cache(srv, chat_hf):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    ids = tokenize(srv, prompt)
    ref = reference(chat_hf, ids)
    body = {"model": "default", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    cold = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    httpx.post(
        srv.url + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": 3}, timeout=60
    )
    warm = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    for r in (cold, warm):
        c = r["choices"][0]
        assert c["text"] == prompt and c["finish_reason"] == "length"
        lp = c["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert close(lp["token_logprobs"][1:], ref)
        assert len(lp["tokens"]) == len(ids) and lp["text_offset"][0] == 0
        assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])  # a dict by text: same-text tokens merge
        assert r["usage"]["completion_tokens"] == 0
    # echo with generation: the prompt's tokens, then the completion's.
    gen = httpx.post(
        srv.url + "/v1/completions",
        timeout=60,
        json={**body, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    ).json()
    c = gen["choices"][0]
    assert c["text"].startswith(prompt) and len(c["logprobs"]["tokens"]) == len(ids) + 4
    # Streamed: the first chunk carries the prompt.
    with httpx.stream(
        "POST", srv.url + "/v1/completions", json={**body, "stream": True, "max_tokens": 2}, timeout=60
    ) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith(prompt)
    assert close(chunks[0]["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)], ref)


def test_native_input_logprobs(srv, chat_hf):
    ids = tokenize(srv, "Hello there, how are you doing today?")
    ref = reference(chat_hf, ids)
    r = httpx.post(srv.url + "/generate", timeout=60, json={
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
        "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})  # fmt: skip
    meta = r.json()["meta_info"]
    inp = meta["input_token_logprobs"]
    assert inp[0][0] is None and [x[1] for x in inp] == ids and all(isinstance(x[2], str) for x in inp)
    assert close([x[0] for x in inp[1:]], ref)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    assert len(meta["output_token_logprobs"]) == 2 and isinstance(meta["output_token_logprobs"][0][2], str)
    # From a later start, and a batch of texts.
    r = httpx.post(srv.url + "/generate", timeout=60, json={
        "text": ["Hello there, how are you doing today?", "Fine."], "return_logprob": True,
        "logprob_start_len": 3, "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
    first, second = r.json()
    assert close([x[0] for x in first["meta_info"]["input_token_logprobs"]], ref[2:])
    assert len(second["meta_info"]["input_token_logprobs"]) == len(tokenize(srv, "Fine.")) - 3


@pytest.mark.parametrize("value", ["3", -5, 1.5])
def test_bad_logprob_start_len(srv, value):
    r = httpx.post(srv.url + "/generate", timeout=30, json={
        "text": "x", "return_logprob": True, "logprob_start_len": value})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_generate_with_max_new_tokens_0_is_a_scoring_request(srv, chat_hf):
    # SGLang's spelling of scoring: the validation turns it into the request's scoring field, and
    # the engine runs the prompt for its logprobs and draws no token.
    ids = tokenize(srv, "Scoring draws no token, it only reads the prompt.")
    r = httpx.post(srv.url + "/generate", timeout=60, json={
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0}})  # fmt: skip
    out = r.json()
    assert r.status_code == 200 and out["output_ids"] == [] and out["text"] == "", r.text
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == []
    assert close([x[0] for x in meta["input_token_logprobs"][1:]], reference(chat_hf, ids))
    # Without prompt logprobs there is nothing to compute: it ends at once, the same way.
    r = httpx.post(srv.url + "/generate", timeout=60, json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0}})
    out = r.json()
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length", r.text
    # "scoring" is the engine's field, not the client's: sent, it is an unknown sampling parameter.
    r = httpx.post(srv.url + "/generate", timeout=60, json={"input_ids": ids, "sampling_params": {"scoring": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "scoring", r.text


def test_chat_with_max_tokens_0_answers_nothing_with_length(srv):
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] > 0
