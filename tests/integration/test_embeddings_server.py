"""/v1/embeddings (openai-python's client, float and base64), /v1/score and /v1/rerank on the real
server with the tiny chat model in fp32: equal to transformers on the same weights; bad input is a
4xx in the OpenAI shape that submits nothing; a second server with --pooling mean and --api-key."""

from __future__ import annotations

import base64
import re
import time

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.helpers import hf_model
from tests.integration.conftest import ENGINE_ARGS, started_server
from tests.server_harness import Server

TOL = 1e-5
LONG = "The quick brown fox jumps over the lazy dog while the cat watches. " * 3  # > a 64-token chunk


@pytest.fixture(scope="module")
def chat_hf(chat_model):
    return hf_model(chat_model)


def tokenize(srv, text: str) -> list[int]:
    return httpx.post(srv.url + "/tokenize", json={"prompt": text}, headers=srv.headers).json()["tokens"]


@torch.no_grad()
def hf_embedding(model, ids: list[int], pooling: str = "last") -> torch.Tensor:
    h = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = h[-1] if pooling == "last" else h.mean(0)
    return v / v.norm()


@torch.no_grad()
def hf_next_logprobs(model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)


def close(a, b: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(a, dtype=torch.float32), b, atol=TOL)


def requests_seen(srv) -> float:
    """Requests the front has seen end (refused by the engine included): what a refusal must not add."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^kvledger_requests_total\{[^}]*\} (\S+)$", text, re.M))


def test_embeddings_with_the_openai_client(srv, client, chat_hf):
    texts = ["Hello there", LONG, "ok"]
    ids = [tokenize(srv, t) for t in texts]
    assert len(ids[1]) > 64  # chunked (--chunked-prefill-size 64)
    # A cached prefix first: last pooling may use it and must still be right.
    client.completions.create(model="default", prompt=LONG, max_tokens=2)
    floats = client.embeddings.create(model="default", input=texts, encoding_format="float")
    b64 = client.embeddings.create(model="default", input=texts)  # the SDK asks for base64 and decodes it
    assert floats.object == "list" and floats.model and len(floats.data) == 3
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for i, (want_ids, f, b) in enumerate(zip(ids, floats.data, b64.data)):
        assert f.index == b.index == i and f.object == "embedding"
        assert close(f.embedding, hf_embedding(chat_hf, want_ids))
        assert close(b.embedding, hf_embedding(chat_hf, want_ids))
    # base64 on the wire: little-endian float32 bytes.
    raw = httpx.post(
        srv.url + "/v1/embeddings", json={"input": texts[2], "encoding_format": "base64"}, timeout=60
    ).json()["data"][0]["embedding"]
    assert isinstance(raw, str)
    vec = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert vec.shape == (64,) and close(vec.tolist(), hf_embedding(chat_hf, ids[2]))
    # Token ids and lists of token ids, as OpenAI accepts them.
    one = client.embeddings.create(model="default", input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and close(one.data[0].embedding, hf_embedding(chat_hf, ids[0]))
    many = client.embeddings.create(model="default", input=ids[1:], encoding_format="float")
    assert [close(d.embedding, hf_embedding(chat_hf, x)) for d, x in zip(many.data, ids[1:])] == [True, True]
    single = client.embeddings.create(model="default", input="Hello there", encoding_format="float")
    # The same text alone: within float32 rounding of its row in the batch of three (the prefill's
    # GEMMs over other row counts need not round alike: 0.10939953 vs 0.10939950 on an AMD Zen 4).
    assert close(single.data[0].embedding, torch.tensor(floats.data[0].embedding))


def test_embedding_refusals_submit_nothing(srv, client):
    url = srv.url + "/v1/embeddings"
    before = requests_seen(srv)
    cases = [
        ({"model": "default", "input": ""}, "input"),
        ({"model": "default", "input": []}, "input"),
        ({"model": "default", "input": ["a", ""]}, "input.1"),  # string items named by index too
        ({"model": "default", "input": ["a", "b", ""]}, "input.2"),
        ({"model": "default", "input": [[1, 2], []]}, "input.1"),
        ({"model": "default", "input": {"text": "a"}}, "input"),
        ({"model": "default", "input": [1, "a"]}, "input"),
        ({"model": "default", "input": 3}, "input"),
        ({"model": "default"}, "input"),
        ({"model": "default", "input": [5, 100000]}, "input"),
        ({"model": "default", "input": [[5] * 1024]}, "input"),  # the whole context
        ({"model": "default", "input": ["x"] * 2049}, "input"),
        ({"model": "default", "input": "a", "dimensions": 8}, "dimensions"),
        ({"model": "default", "input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "default", "input": "a", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ]
    for body, param in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (body, err)
    r = httpx.post(url, json={"model": "default", "input": "a", "dimensions": 8}, timeout=30)
    assert "Matryoshka" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "nope", "input": "a"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="default", input="a", dimensions=4)
    assert requests_seen(srv) == before  # nothing reached the engine


def test_score_is_the_next_token_distribution(srv, chat_hf):
    query, items, labels = "The capital of France is", [" Paris", " a city by the sea"], [5, 40, 200]
    body = {"model": "default", "query": query, "items": items, "label_token_ids": labels}
    r = httpx.post(srv.url + "/v1/score", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "scoring" and len(got["scores"]) == 2
    soft = httpx.post(srv.url + "/v1/score", json={**body, "apply_softmax": True}, timeout=60).json()
    first = httpx.post(srv.url + "/v1/score", json={**body, "item_first": True}, timeout=60).json()
    for j, item in enumerate(items):
        lp = hf_next_logprobs(chat_hf, tokenize(srv, query + item))
        assert close(got["scores"][j], lp[labels].exp())
        assert close(soft["scores"][j], torch.softmax(lp[labels], 0))
        assert close(first["scores"][j], hf_next_logprobs(chat_hf, tokenize(srv, item + query))[labels].exp())
    # Token ids: query + item joined as ids.
    q, its = tokenize(srv, query), [tokenize(srv, i) for i in items]
    ids = httpx.post(srv.url + "/v1/score", json={**body, "query": q, "items": its}, timeout=60).json()
    assert close(ids["scores"][1], hf_next_logprobs(chat_hf, q + its[1])[labels].exp())
    assert httpx.post(srv.url + "/v1/score", json={**body, "items": []}, timeout=60).json()["scores"] == []
    before = requests_seen(srv)
    for bad, param in [
        ({"label_token_ids": None}, "label_token_ids"),
        ({"label_token_ids": []}, "label_token_ids"),
        ({"label_token_ids": [1, 10**6]}, "label_token_ids"),
        ({"label_token_ids": ["a"]}, "label_token_ids"),
        ({"items": [[1, 2]]}, "items"),  # text query, id items
        ({"query": "", "items": ["a", ""]}, "items.1"),  # an empty prompt, named by its index
        ({"query": None}, "query"),
        ({"apply_softmax": "yes"}, "apply_softmax"),
    ]:
        r = httpx.post(srv.url + "/v1/score", json={**body, **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    assert requests_seen(srv) == before


def test_rerank_by_embedding_cosine(srv, chat_hf):
    query, docs = "Where do llamas live?", ["Llamas live in the Andes.", "Paris is in France.", LONG]
    r = httpx.post(srv.url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["score_type"] == "cosine_similarity" and out["pooling"] == "last"
    q = hf_embedding(chat_hf, tokenize(srv, query))
    want = [float(q @ hf_embedding(chat_hf, tokenize(srv, d))) for d in docs]
    res = out["results"]
    assert [x["index"] for x in res] == sorted(range(3), key=lambda i: -want[i])
    for x in res:
        assert abs(x["relevance_score"] - want[x["index"]]) < TOL
        assert x["document"] == {"text": docs[x["index"]]}
    assert out["usage"]["prompt_tokens"] == len(tokenize(srv, query)) + sum(len(tokenize(srv, d)) for d in docs)
    top = httpx.post(
        srv.url + "/v1/rerank", json={"query": query, "documents": docs, "top_n": 1, "return_documents": False}
    ).json()["results"]
    assert len(top) == 1 and top[0]["index"] == res[0]["index"] and "document" not in top[0]
    before = requests_seen(srv)
    for bad, param in [
        ({"top_n": -1}, "top_n"),
        ({"documents": ["a", ""]}, "documents.1"),  # named by its index
        ({"documents": "a"}, "documents"),
        ({"query": ""}, "query"),
        ({"instruct": "be nice"}, "instruct"),
    ]:
        r = httpx.post(srv.url + "/v1/rerank", json={"query": query, "documents": docs, **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    assert requests_seen(srv) == before


@pytest.fixture(scope="module")
def mean_keyed(chat_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "mean.log")
    for s in started_server(chat_model, log, "--pooling", "mean", "--api-key", "k"):
        s.headers = {"Authorization": "Bearer k"}
        yield s
        s.wait_idle_clean()


def test_mean_pooling_and_the_api_key(mean_keyed, chat_hf):
    srv = mean_keyed
    for path, body in [
        ("/v1/embeddings", {"input": "a"}),
        ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [3]}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
    ]:
        r = httpx.post(srv.url + path, json=body, timeout=30)
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}, path
        assert httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=60).status_code == 200, path
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
    texts = [LONG, "Hello there"]
    client.completions.create(model="default", prompt=LONG, max_tokens=2)  # cached: mean must not use it
    out = client.embeddings.create(model="default", input=texts)
    for d, t in zip(out.data, texts):
        assert close(d.embedding, hf_embedding(chat_hf, tokenize(srv, t), "mean"))
    assert httpx.post(srv.url + "/v1/rerank", headers=srv.headers, json={"query": "a", "documents": ["b"]}).json()[
        "pooling"
    ] == "mean"


def test_a_batch_larger_than_the_queue(srv, client, chat_hf):
    """100 inputs on a server that queues 64 (--max-queued-requests): the call feeds the engine at
    most --max-running-requests at a time instead of overflowing its queue with 429s."""
    texts = [f"item {i}" for i in range(100)]
    r = httpx.post(srv.url + "/v1/embeddings", json={"input": texts}, timeout=600)
    assert r.status_code == 200, r.text
    out = openai.types.CreateEmbeddingResponse.model_validate(r.json())
    assert [d.index for d in out.data] == list(range(100))
    for i in (0, 57, 99):
        assert close(out.data[i].embedding, hf_embedding(chat_hf, tokenize(srv, texts[i])))


def test_a_client_that_leaves_mid_batch_leaves_nothing_running(chat_model, tmp_path):
    """The batch's requests in the engine are aborted through the release path, and those not yet
    submitted never are. Every forward is slowed (a test hook) so that the client surely leaves with
    most of the batch unsubmitted: on a quiet machine the tiny model could otherwise finish all 200
    inside the client's 1.5 s, and the test would prove nothing."""
    s = Server(chat_model, *ENGINE_ARGS, log_path=str(tmp_path / "slow.log"), env={"KVLEDGER_TEST_STEP_DELAY_S": "0.05"})
    try:
        s.wait_healthy()
        before = requests_seen(s)
        texts = [f"{i} " + "lorem ipsum " * 50 for i in range(200)]
        with pytest.raises(httpx.TimeoutException):
            httpx.post(s.url + "/v1/embeddings", json={"input": texts}, timeout=1.5)
        time.sleep(3)
        s.wait_idle_clean(timeout=30)
        assert requests_seen(s) - before <= 2 * 8  # at most --max-running-requests at a time ever went in
    finally:
        s.stop()
