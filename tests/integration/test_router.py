"""Data-parallel replicas behind SGLang's own router (``sglang-router``, a pinned test dependency,
started as a subprocess): requests spread over the replicas (round robin, cache-aware), the
routing-key header ``x-smg-routing-key`` under ``--policy manual`` keeps a conversation on one
replica, the router's health checks and ``/flush_cache`` fan-out work; every replica's books clean."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.conftest import ENGINE_ARGS
from tests.server_harness import Router, Server

pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (.ci/run installs it)")


@pytest.fixture(scope="module")
def replicas(chat_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    servers = [Server(chat_model, *ENGINE_ARGS, log_path=str(logs / f"r{i}.log")) for i in range(2)]
    try:
        for s in servers:
            s.wait_healthy()
        yield servers
    finally:
        for s in servers:
            s.stop()


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
