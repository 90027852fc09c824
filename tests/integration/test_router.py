"""Data-parallel replicas behind SGLang's own router (``sglang-router``, a pinned test dependency,
started as a subprocess): requests spread over the replicas (round robin, cache-aware), the
routing-key header ``x-smg-routing-key`` under ``--policy manual`` keeps a conversation on one
replica, the router's health checks and ``/flush_cache`` fan-out work; every replica's books clean."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Router, Server

pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")


@pytest.fixture(scope="module")
def replicas(chat_model, server, tmp_path_factory):
    """Two replicas on the same model and ENGINE_ARGS: the session's server (``server``, already
    started for the other integration tests) and one more. A second server of the module's own cost
    one more start (~15 s of the suite on 2 cores) for a replica no different. Every test below
    ends with both replicas' books clean; the shared one must not have restarted its engine."""
    extra = Server(chat_model, *ENGINE_ARGS, log_path=str(tmp_path_factory.mktemp("replicas") / "r1.log"))
    restarts = server.info()["engine_restarts"]
    try:
        extra.wait_healthy()
        yield [server, extra]
        assert server.info()["engine_restarts"] == restarts, server.logs()[-2000:]
    finally:
        extra.stop()


def regular(workers: list[Server], policy: str) -> list[str]:
    return ["--worker-urls", *[w.url for w in workers], "--policy", policy]


def served(s: Server) -> float:
    """Requests a replica has finished, from its own metrics."""
    total = 0.0
    for line in httpx.get(s.url + "/metrics").text.splitlines():
        if line.startswith("kvledger_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_requests_spread_over_replicas(replicas, tmp_path, policy):
    router = Router(regular(replicas, policy), str(tmp_path / "router.log"))
    try:
        before = [served(s) for s in replicas]
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        for i in range(8):
            prompt = f"Request number {i}: " + "different text " * (i + 1)
            r = c.completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0)
            assert r.choices[0].text is not None
        chat = c.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.content is not None
        # Native /generate through the router (0.3.2 takes one text per request in regular mode).
        r = httpx.post(
            router.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}}, timeout=60
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
        r = httpx.post(router.url + "/generate", json={"text": "b", "stream": True}, timeout=60)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        gained = [served(s) - b for s, b in zip(replicas, before)]
        assert sum(gained) >= 11 and (policy == "cache_aware" or min(gained) > 0), gained
        assert httpx.post(router.url + "/flush_cache", timeout=30).status_code == 200
    finally:
        router.stop()
    for s in replicas:
        s.wait_idle_clean()


def test_routing_key_keeps_a_conversation_on_one_replica(replicas, tmp_path):
    router = Router(regular(replicas, "manual"), str(tmp_path / "router.log"))
    try:
        for key in ("conversation-a", "conversation-b", "conversation-c"):
            before = [served(s) for s in replicas]
            for turn in range(4):
                r = httpx.post(router.url + "/generate", headers={"x-smg-routing-key": key}, timeout=60,
                               json={"text": f"{key} turn {turn}", "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
                assert r.status_code == 200, r.text
            gained = sorted(served(s) - b for s, b in zip(replicas, before))
            assert gained == [0, 4], (key, gained)  # all four turns on the same replica
    finally:
        router.stop()
    for s in replicas:
        s.wait_idle_clean()


def test_cache_aware_keeps_shared_prefixes_together(replicas, tmp_path):
    """32 requests in 4 families of a shared system prompt: every request after a family's first finds
    the family's prefix in its replica's cache; under concurrent load the router's balance gate (set
    low here) spreads requests over both replicas. (Router 0.3.2 sent every cache miss to the same
    worker here rather than to the smaller tree, so the spread is shown under load.)"""
    gate = ["--balance-abs-threshold", "1", "--balance-rel-threshold", "1.0"]
    router = Router([*regular(replicas, "cache_aware"), *gate], str(tmp_path / "router.log"))
    try:
        for s in replicas:
            assert httpx.post(s.url + "/flush_cache", timeout=30).status_code == 200
        before = [served(s) for s in replicas]
        topics = ("Astronomy", "Baking", "Chess", "Diving")
        families = [
            f"{t} assistant. " + f"Only talk about {t.lower()} and nothing else. " * 8 for t in topics
        ]

        def ask(i: int) -> int:
            # (an OpenAI route: the router's tree reads its prompt text)
            r = httpx.post(router.url + "/v1/completions", timeout=60,
                           json={"model": "default", "prompt": families[i % 4] + f"Question {i}?", "max_tokens": 8})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        hits = {f: [] for f in range(4)}
        for i in range(16):
            hits[i % 4].append(ask(i))
        for f, cached in hits.items():
            assert all(c > 100 for c in cached[1:]), (f, cached)  # the family's prefix, every time
        with cf.ThreadPoolExecutor(8) as ex:
            list(ex.map(ask, range(16, 32)))
        gained = [served(s) - b for s, b in zip(replicas, before)]
        assert sum(gained) == 32 and min(gained) > 0, gained
    finally:
        router.stop()
    for s in replicas:
        s.wait_idle_clean()


def test_a_conversation_under_its_routing_key_reuses_its_kv_every_turn(replicas, tmp_path):
    """What a multi-turn client does behind the router (sessions cannot pass through it: router
    0.3.2 does not forward /open_session): send each turn with the conversation's routing key; the
    turns meet their own earlier KV on the replica the key is bound to."""
    router = Router(regular(replicas, "manual"), str(tmp_path / "router.log"))
    try:
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0,
                          default_headers={"x-smg-routing-key": "chat-42"})  # fmt: skip
        msgs = [{"role": "system", "content": "You are terse. " * 10}]
        cached = []
        for turn in range(3):
            msgs.append({"role": "user", "content": f"Turn {turn}: tell me something."})
            r = c.chat.completions.create(model="default", messages=msgs, max_tokens=4, temperature=0)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            cached.append(r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0)
        assert all(x > 0 for x in cached[1:]), cached
    finally:
        router.stop()
    for s in replicas:
        s.wait_idle_clean()
