"""The hostile HTTP client (tests/fuzz/hostile_http.py) against a real server with two tenants' keys
(issue 50): a few hundred seeded attacks of every kind, each refused with a 4xx (or the connection
closed) in bounded time, never a 5xx; another tenant's ids are 404s; a bystander's greedy request
keeps giving the same tokens all along; no engine restart; the books clean at the end. The PD and
TP ports get theirs in test_hostile_pd.py and test_hostile_tp.py; bench/hostile_fuzz.py runs all of
them for longer."""

from __future__ import annotations

import random
import threading
from typing import ClassVar

import httpx
import pytest

from tests.fuzz import hostile_http
from tests.integration.conftest import started_server

KEYS = ("tenant-a-key", "tenant-b-key")
BODY_TIMEOUT_S = 2.0
ATTACKS = 260  # every kind 20 times


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    yield from started_server(
        chat_model, str(tmp_path_factory.mktemp("hostile") / "s.log"),
        "--api-key", *KEYS, "--admin-api-key", "admin-key", "--body-timeout", str(BODY_TIMEOUT_S),
    )  # fmt: skip


class Bystander(threading.Thread):
    """Sends one greedy request again and again while the attacks run: each answer must be the
    reference's tokens, in bounded time."""

    BODY: ClassVar[dict] = {"input_ids": [5, 6, 7, 8],
                            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}  # fmt: skip

    def __init__(self, url: str, key: str):
        super().__init__(daemon=True)
        self.url, self.headers = url, {"Authorization": f"Bearer {key}"}
        self.want = self._ask()
        self.stop, self.runs, self.errors = threading.Event(), 0, []

    def _ask(self) -> list[int]:
        r = httpx.post(self.url + "/generate", json=self.BODY, headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()["output_ids"]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                got = self._ask()
                if got != self.want:
                    self.errors.append(f"tokens {got} != {self.want}")
                self.runs += 1
            except Exception as e:  # any failure is the finding
                self.errors.append(repr(e))


def test_hostile_clients_are_refused_and_the_bystander_is_served(server):
    server.headers = {"Authorization": "Bearer admin-key"}
    restarts = server.info()["engine_restarts"]
    target = hostile_http.Target(server.url, KEYS, max_body_bytes=200000, body_timeout_s=BODY_TIMEOUT_S)
    hostile_http.own_things(target)
    bystander = Bystander(server.url, KEYS[1])
    bystander.start()
    problems, kinds = [], set()
    try:
        for kind, attack in hostile_http.attacks(random.Random(50), ATTACKS):
            kinds.add(kind)
            problem = hostile_http.judge(kind, attack(target), target)
            if problem:
                problems.append(problem)
    finally:
        bystander.stop.set()
        bystander.join(60)
    assert not problems, problems[:20]
    assert len(kinds) == 13
    assert bystander.runs > 10 and not bystander.errors, (bystander.runs, bystander.errors[:5])
    for sid in target.owned["sessions"]:  # tenant A's sessions and responses are still theirs
        r = httpx.post(server.url + "/close_session", json={"session_id": sid}, headers=target.headers(), timeout=30)
        assert r.status_code == 200, r.text
    info = server.wait_idle_clean(timeout=30)
    assert info["engine_restarts"] == restarts
