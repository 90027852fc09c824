"""One OpenAI-client suite (issue 56), run as a user would against a single server, the
``--dp-size 2`` front and a PD pair behind SGLang's router: the same calls, the same answers' shapes.

Each part is a function of an ``openai.OpenAI`` client (and the base URL, for the routes the SDK
has no method for); ``run`` runs the parts a deployment serves."""

from __future__ import annotations

import httpx
import openai

MSGS = [{"role": "user", "content": "Say something."}]


def chat(c: openai.OpenAI, url: str) -> None:
    r = c.chat.completions.create(model="default", messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                  top_logprobs=2)  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    stream = c.chat.completions.create(model="default", messages=MSGS, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == r.choices[0].message.content  # greedy: streamed or not, the same answer
    r2 = c.chat.completions.create(messages=MSGS, model="default", max_tokens=2, n=2, temperature=0)
    assert len(r2.choices) == 2


def completions(c: openai.OpenAI, url: str) -> None:
    r = c.completions.create(model="default", prompt=["One", "Two"], max_tokens=3, temperature=0)
    assert len(r.choices) == 2 and r.usage.prompt_tokens >= 2
    stream = c.completions.create(model="default", prompt="One", max_tokens=3, temperature=0, stream=True)
    streamed = "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert streamed == next(x.text for x in r.choices if x.index == 0)


def responses(c: openai.OpenAI, url: str) -> None:
    """Create, continue with ``previous_response_id`` (wherever the first turn ran), retrieve,
    cancel (a synchronous response: 400), delete, then a 404."""
    first = c.responses.create(model="default", input="Hello", max_output_tokens=3, temperature=0)
    assert first.status in ("completed", "incomplete") and first.id.startswith("resp_")
    for _ in range(3):  # behind a balancer each follow-up may land anywhere
        nxt = c.responses.create(model="default", input="More", previous_response_id=first.id, max_output_tokens=2)
        assert nxt.previous_response_id == first.id
        assert nxt.usage.input_tokens > first.usage.input_tokens  # the first turn is in its prompt
        assert c.responses.retrieve(first.id).id == first.id
    streamed = [e.type for e in c.responses.create(model="default", input="Hi", max_output_tokens=2, stream=True)]
    assert streamed[0] == "response.created" and streamed[-1] in ("response.completed", "response.incomplete")
    try:
        c.responses.cancel(first.id)
        raise AssertionError("a synchronous response was cancelled")
    except openai.BadRequestError as e:
        assert e.body["code"] == "response_not_cancellable"  # type: ignore[index]
    assert c.responses.delete(first.id) is None
    try:
        c.responses.retrieve(first.id)
        raise AssertionError("a deleted response was found")
    except openai.NotFoundError:
        pass


def pooling(c: openai.OpenAI, url: str) -> None:
    """Embeddings (the SDK), score, rerank, tokenize and detokenize (their JSON routes)."""
    e = c.embeddings.create(model="default", input=["a", "b c"])
    assert [d.index for d in e.data] == [0, 1] and len(e.data[0].embedding) > 1
    with httpx.Client(base_url=url, timeout=60) as h:
        s = h.post("/v1/score", json={"model": "default", "query": "a", "items": ["b", "c"], "label_token_ids": [1]})
        assert s.status_code == 200 and len(s.json()["scores"]) == 2, s.text
        r = h.post("/v1/rerank", json={"query": "a", "documents": ["b", "c"]})  # no model: the served one
        assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
        t = h.post("/tokenize", json={"prompt": "hello"})
        assert t.status_code == 200, t.text
        d = h.post("/detokenize", json={"tokens": t.json()["tokens"]})
        assert d.status_code == 200 and d.json()["prompt"] == "hello", d.text


def models(c: openai.OpenAI, url: str) -> None:
    served = c.models.list().data[0]
    assert served.root == served.id and c.models.retrieve(served.id).id == served.id


ALL = (chat, completions, responses, pooling, models)


def run(url: str, parts=ALL) -> None:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    for part in parts:
        part(c, url)
