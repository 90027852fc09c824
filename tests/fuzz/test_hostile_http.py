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
from tests.helpers import tiny_image
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


def beside(bystander: Bystander, target, attacks) -> tuple[list, set]:
    """Run ``attacks`` (kind, attack) at ``target`` while ``bystander`` is served; the judges'
    problems and the kinds run."""
    bystander.start()
    problems, kinds = [], set()
    try:
        for kind, attack in attacks:
            kinds.add(kind)
            problem = hostile_http.judge(kind, attack(target), target)
            if problem:
                problems.append(problem)
    finally:
        bystander.stop.set()
        bystander.join(60)
    return problems, kinds


def test_hostile_clients_are_refused_and_the_bystander_is_served(server):
    server.headers = {"Authorization": "Bearer admin-key"}
    restarts = server.info()["engine_restarts"]
    target = hostile_http.Target(server.url, KEYS, max_body_bytes=200000, body_timeout_s=BODY_TIMEOUT_S)
    hostile_http.own_things(target)
    bystander = Bystander(server.url, KEYS[1])
    problems, kinds = beside(bystander, target, hostile_http.attacks(random.Random(50), ATTACKS))
    assert not problems, problems[:20]
    assert len(kinds) == 13
    assert bystander.runs > 10 and not bystander.errors, (bystander.runs, bystander.errors[:5])
    for sid in target.owned["sessions"]:  # tenant A's sessions and responses are still theirs
        r = httpx.post(server.url + "/close_session", json={"session_id": sid}, headers=target.headers(), timeout=30)
        assert r.status_code == 200, r.text
    info = server.wait_idle_clean(timeout=30)
    assert info["engine_restarts"] == restarts


@pytest.fixture(scope="module")
def vlm_server(llava, tmp_path_factory):
    yield from started_server(
        llava[0], str(tmp_path_factory.mktemp("hostile_vlm") / "s.log"), "--api-key", *KEYS,
        "--admin-api-key", "admin-key", "--max-images-per-prompt", "2", "--page-size", "4",
    )  # fmt: skip


class ImageBystander(Bystander):
    """A greedy request with an image, again and again, beside the bad image parts."""

    BODY: ClassVar[dict] = {
        "text": "<|user|>see <image></s><|assistant|>",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }

    def __init__(self, url: str, key: str):
        import base64

        ImageBystander.BODY = {**self.BODY, "image_data": [base64.b64encode(hostile_http._png(tiny_image(5))).decode()]}
        super().__init__(url, key)


def test_bad_image_parts_are_400s_naming_the_part_and_the_bystander_is_served(vlm_server):
    """Corrupt, truncated, bomb, bad base64, remote URL (off), too many, unsupported format, junk URL
    values: each on chat, /generate or Responses a 400 naming the part; the server serves an image
    bystander all along; no engine restart; nothing held after."""
    vlm_server.headers = {"Authorization": "Bearer admin-key"}
    restarts = vlm_server.info()["engine_restarts"]
    target = hostile_http.Target(vlm_server.url, KEYS, max_body_bytes=8 << 20, body_timeout_s=30)
    bystander = ImageBystander(vlm_server.url, KEYS[1])
    problems, kinds = beside(bystander, target, hostile_http.image_attacks(random.Random(52), 48, max_images=2))
    assert not problems, problems[:20]
    assert len(kinds) == len(hostile_http.IMAGE_KINDS)
    assert bystander.runs > 3 and not bystander.errors, (bystander.runs, bystander.errors[:5])
    info = vlm_server.wait_idle_clean(timeout=30)
    assert info["engine_restarts"] == restarts
    assert info["memory"].get("image_embed_tokens", 0) == 0
