"""The null walk (issue 56): every optional field of every OpenAI-shaped and native generation
route, sent as JSON null one at a time, is answered as if it were left out. Shared by the single
server's test and the ``--dp-size`` front's (a body the server accepts is accepted behind the front)."""

from __future__ import annotations

import httpx

from kvledger.server import protocol
from tests.unit.test_null_fields import optional_fields

SAMPLING = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
            "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "n"]  # fmt: skip

# route -> (body type, the least body that answers quickly). Nested bodies are walked in place.
ROUTES: dict[str, tuple[type, dict]] = {
    "/generate": (protocol.GenerateRequest, {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
    "/v1/completions": (protocol.CompletionRequest, {"model": "default", "prompt": "hi", "max_tokens": 1}),
    "/v1/chat/completions": (
        protocol.ChatRequest,
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
    "/v1/responses": (protocol.ResponsesRequest, {"model": "default", "input": "hi", "max_output_tokens": 1}),
    "/v1/embeddings": (protocol.EmbeddingRequest, {"model": "default", "input": "hi"}),
    "/v1/score": (protocol.ScoreRequest, {"model": "default", "query": "a", "items": ["b"], "label_token_ids": [1]}),
    "/v1/rerank": (protocol.RerankRequest, {"model": "default", "query": "a", "documents": ["b"]}),
    "/tokenize": (protocol.TokenizeRequest, {"model": "default", "prompt": "hi"}),
    "/detokenize": (protocol.DetokenizeRequest, {"model": "default", "tokens": [70]}),
}


def null_bodies() -> list[tuple[str, str, dict]]:
    """``(route, field, body)`` for every optional field of every route, one null at a time."""
    out = []
    for route, (t, base) in ROUTES.items():
        for name in optional_fields(t):
            if name not in base:  # (the fields the least body needs: their null is a missing prompt)
                out.append((route, name, {**base, name: None}))
    chat = ROUTES["/v1/chat/completions"][1]
    for name in optional_fields(protocol.ChatMessage):
        out.append(("/v1/chat/completions", f"messages.0.{name}",
                    {**chat, "messages": [{**chat["messages"][0], name: None}]}))  # fmt: skip
    for name in optional_fields(protocol.StreamOptions):
        out.append(("/v1/chat/completions", f"stream_options.{name}",
                    {**chat, "stream": True, "stream_options": {name: None}}))  # fmt: skip
    gen = ROUTES["/generate"][1]
    for name in SAMPLING:
        out.append(("/generate", f"sampling_params.{name}", {**gen, "sampling_params": {"max_new_tokens": 1, name: None}}))
    return out


def walk(url: str, headers: dict | None = None) -> list[str]:
    """The fields whose null was not answered as their absence (200): empty when all pass."""
    bad = []
    with httpx.Client(base_url=url, timeout=60, headers=headers) as c:
        for route, name, body in null_bodies():
            r = c.post(route, json=body)
            if r.status_code != 200:
                bad.append(f"{route} {name}: {r.status_code} {r.text[:160]}")
    return bad
