"""One prefix-cache namespace per request, derived once (``protocol._Salted.salt``) for every route
that runs a prompt (issue 50, item 4: /v1/score, /v1/rerank and /v1/responses dropped the salt, so a
salted prompt's KV was reusable, and timeable, by another tenant). Every POST route of the app is
either such a route or named here as one that runs no prompt, so a new route cannot forget."""

from __future__ import annotations

import uuid

import httpx
import pytest

from kvledger.server import protocol
from kvledger.server.routes import ROUTERS
from tests.nulls import ROUTES

PROMPT_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                 "/v1/score", "/v1/rerank")  # fmt: skip
NO_PROMPT = {
    "/tokenize", "/detokenize", "/abort_request", "/flush_cache", "/open_session", "/close_session",
    "/pause_generation", "/continue_generation", "/update_weights_from_disk", "/load_lora_adapter",
    "/unload_lora_adapter", "/v1/responses/{response_id}/cancel", "/dashboard/login",
}  # fmt: skip


def test_every_route_that_runs_a_prompt_takes_the_salt():
    posts = {r.path for router in ROUTERS for r in router.routes if "POST" in getattr(r, "methods", ())}
    assert posts == set(PROMPT_ROUTES) | NO_PROMPT, "a new POST route: say whether it runs a prompt"
    for route in PROMPT_ROUTES:
        t = ROUTES[route][0]
        assert issubclass(t, protocol._Salted), route


def _ask(url: str, route: str, text: str, salt: dict) -> int:
    """Run ``text`` through ``route`` with ``salt``; the prompt tokens its answer says were cached."""
    body = {"model": "default", **salt}
    if route == "/generate":
        body = {"text": text, "sampling_params": {"max_new_tokens": 1}, **salt}
    elif route == "/v1/completions":
        body |= {"prompt": text, "max_tokens": 1}
    elif route == "/v1/chat/completions":
        body |= {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    elif route == "/v1/responses":
        body |= {"input": text, "max_output_tokens": 1}
    elif route == "/v1/embeddings":
        body |= {"input": text}
    elif route == "/v1/score":
        body |= {"query": text, "items": [" a"], "label_token_ids": [5]}
    else:
        body |= {"query": text, "documents": ["a"]}
    r = httpx.post(url + route, json=body, timeout=60)
    assert r.status_code == 200, (route, r.text)
    out = r.json()
    if route == "/generate":
        return out["meta_info"]["cached_tokens"]
    usage = out["usage"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return details["cached_tokens"]


@pytest.mark.parametrize("route", PROMPT_ROUTES)
@pytest.mark.parametrize("salt_field", ["cache_salt", "extra_key"])
def test_a_salted_prompt_is_never_a_hit_without_its_salt(srv, route, salt_field):
    text = f"{uuid.uuid4().hex} " * 8  # well over a page, new to the cache
    salt = {salt_field: "tenant-a"}
    assert _ask(srv.url, route, text, salt) == 0
    assert _ask(srv.url, route, text, {}) == 0  # another tenant: no hit, nothing to time
    assert _ask(srv.url, route, text, {salt_field: "tenant-b"}) == 0
    assert _ask(srv.url, route, text, salt) > 0  # the same salt finds its own KV
