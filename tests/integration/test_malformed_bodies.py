"""No exception escapes a route as a 500 for bad input (issue 37): every route of the app gets
malformed bodies — not JSON, the wrong JSON, deep nesting, huge numbers — and every field of a
valid body replaced by wrong types, nulls, huge and negative numbers, empty lists and nested
garbage. Each answer is a 4xx in the OpenAI error shape (or a 2xx where the value happens to be
valid), on a connection that stays open, and the server keeps serving with its books balanced."""

from __future__ import annotations

import httpx

# A valid body per route that takes one; the fields of each are replaced one at a time below.
HI = [{"role": "user", "content": "hi"}]
VALID: dict[str, dict] = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0, "stop": ["x"],
                                                    "timeout": 30},
                  "return_logprob": False, "top_logprobs_num": 0, "stream": False, "rid": None, "priority": None,
                  "image_data": None,
                  "lora_path": None},
    "/v1/completions": {"model": "default", "prompt": "hi", "max_tokens": 1, "temperature": 0, "n": 1,
                        "logprobs": None, "stop": None, "echo": False, "seed": 1, "top_p": 1.0,
                        "stream_options": None, "response_format": None, "cache_salt": None, "timeout": None,
                        "priority": None},
    "/v1/chat/completions": {"model": "default", "messages": HI, "max_tokens": 1, "temperature": 0,
                             "logprobs": False, "top_logprobs": None, "stop": None, "tools": None,
                             "tool_choice": None, "response_format": None, "stream_options": None,
                             "chat_template_kwargs": None, "continue_final_message": False, "timeout": None,
                             "priority": None},
    "/v1/responses": {"model": "default", "input": HI, "max_output_tokens": 1, "temperature": 0, "tools": None,
                      "tool_choice": None, "text": None, "instructions": None, "previous_response_id": None,
                      "store": False, "stream": False, "priority": None},
    "/v1/embeddings": {"model": "default", "input": ["hi", "there"], "encoding_format": "float", "dimensions": None,
                       "user": None, "cache_salt": None},
    "/v1/score": {"model": "default", "query": "hi", "items": ["a", "b"], "label_token_ids": [5, 6],
                  "apply_softmax": False, "item_first": False},
    "/v1/rerank": {"model": "default", "query": "hi", "documents": ["a", "b"], "top_n": 1, "return_documents": True},
    "/tokenize": {"model": "default", "prompt": "hi", "add_special_tokens": True},
    "/detokenize": {"model": "default", "tokens": [5, 6]},
    "/abort_request": {"rid": "no-such-request"},
    "/open_session": {"session_id": None, "streaming": True, "timeout": None},
    "/close_session": {"session_id": "no-such-session"},
    "/pause_generation": {"mode": "in_place"},  # each pause that succeeds is continued at once
    "/continue_generation": {},
    "/update_weights_from_disk": {"model_path": "/no/such/checkpoint", "load_format": None,
                                  "abort_all_requests": False},
    "/load_lora_adapter": {"lora_name": "x", "lora_path": "/no/such/adapter"},
    "/unload_lora_adapter": {"lora_name": "no-such-adapter", "lora_int_id": None},
    "/v1/responses/{response_id}/cancel": {},  # (the id in the path: no such response, a 404)
}  # fmt: skip
NESTED = {  # fields inside fields, replaced the same way
    "/generate": [("sampling_params", k) for k in ("max_new_tokens", "temperature", "stop", "top_k", "n",
                                                                "timeout")],
    "/v1/chat/completions": [("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0)],
    "/v1/responses": [("input", 0, "role"), ("input", 0, "content"), ("input", 0)],
}
BODYLESS_POSTS = {"/flush_cache", "/dashboard/login"}  # read no body: anything sent is ignored

BAD_VALUES = [
    None, "x", "", 1.5, -1, 0, 2**70, -(2**70), 1e308, True, [], [None], {}, {"a": [{"b": None}]},
    [{"type": "text", "text": 5}], [{"type": "image_url", "image_url": {"url": "x"}}], [[1, -2], ["x"]],
    # images (a text-only server refuses them; a vision one decodes with limits): corrupt, a local file, loopback
    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}],
    [{"type": "input_image", "image_url": "file:///etc/passwd"}], ["http://127.0.0.1:1/x.png"],
    {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}, {"include_usage": "yes"},
]  # fmt: skip
BAD_RAW = [
    b"", b"{", b"null", b"[]", b"42", b'"text"', b"\xff\xfe\x00", b'{"a": 1} trailing',
    b"[" * 50000 + b"]" * 50000,  # deeper than the JSON parser recurses
    b'{"max_tokens": ' + b"9" * 5000 + b"}",  # an integer longer than Python converts by default
    b'{"prompt": "hi", "messages": "hi", "text": "hi", "tokens": "hi", "rid": 1e999}',
]  # fmt: skip


def _replaced(body: dict, path: tuple, value) -> dict:
    out = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v) for k, v in body.items()}
    node = out
    for key in path[:-1]:
        node[key] = child = (list(node[key]) if isinstance(node[key], list) else dict(node[key]))
        if isinstance(child, list):
            child[0] = dict(child[0]) if isinstance(child[0], dict) else child[0]
        node = child
    node[path[-1]] = value
    return out


def _check(c: httpx.Client, method: str, path: str, status_range: range, **kw) -> None:
    r = c.request(method, path, **kw)
    assert r.status_code in status_range or 200 <= r.status_code < 300, (method, path, kw, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (path, kw, r.text)
    elif path == "/pause_generation":  # a body that happened to be valid: generation goes on
        assert c.post("/continue_generation").status_code == 200


def test_every_route_answers_malformed_bodies_with_a_4xx(srv):
    paths = httpx.get(srv.url + "/openapi.json").json()["paths"]
    posts = {p for p, ops in paths.items() if "post" in ops}
    assert posts == set(VALID) | BODYLESS_POSTS, "a new POST route: give it a valid body here"
    client_errors = range(400, 500)
    # One keep-alive connection throughout: a route that drops it fails the request after.
    with httpx.Client(base_url=srv.url, timeout=60, limits=httpx.Limits(max_connections=1)) as c:
        for path in sorted(posts):
            expect = range(0, 500) if path in BODYLESS_POSTS else client_errors
            for raw in BAD_RAW:
                _check(c, "POST", path, expect, content=raw, headers={"content-type": "application/json"})
        for path, body in VALID.items():
            fields = [(k,) for k in body] + NESTED.get(path, [])
            for field in fields:
                for value in BAD_VALUES:
                    _check(c, "POST", path, client_errors, json=_replaced(body, field, value))
            _check(c, "POST", path, client_errors, json={**body, "unknown_field": {"a": [1]}})
        for path, ops in paths.items():
            if "get" in ops:
                url = path.replace("{model}", "../%00/" + "x" * 3000)
                _check(c, "GET", url + "?a=%ff&a=1&[]=x", range(0, 500))
        assert c.get("/health").status_code == 200
        for session in srv.info()["sessions"]:  # the timeouts and ids that were valid opened sessions
            assert c.post("/close_session", json={"session_id": session["id"]}).status_code == 200
    ok = httpx.post(srv.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
