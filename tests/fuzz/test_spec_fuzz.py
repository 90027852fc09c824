"""Speculation fuzz: random drafts (some right, some wrong, random lengths) over many steps with
aborts, sessions and a small pool (retraction), on the fake model behind the real executor. The
ledger's conservation holds after every step, outputs equal plain decoding, the audit is clean."""

from __future__ import annotations

import random

import pytest

from tests.fakes import V, chain, use_fake_model
from tests.helpers import assert_idle_clean


class RandomDrafts:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def propose(self, req) -> list[int]:
        k = self.rng.randint(0, 6)
        good = chain(req.output_ids[-1] if req.output_ids else req.input_ids[-1], k)
        bad_at = self.rng.randint(0, 8)  # past k: every draft right
        return [(t + 1) % V if j >= bad_at else t for j, t in enumerate(good)]


@pytest.mark.parametrize("seed", range(4))
def test_random_drafts_aborts_and_sessions(make_engine, seed):
    rng = random.Random(seed)
    # mixed_step_ratio=0: the step shapes follow the seed alone, not measured step costs (pacing has its
    # own paced seed, with fixed costs, in test_scheduler_fuzz); paced, how long the sessions' conversations
    # get before the 320-token context refuses or cuts their turns varies from run to run.
    eng = make_engine(page_size=rng.choice([1, 4, 16]), max_total_tokens=320, max_running_requests=10,
                      chunked_prefill_size=rng.choice([8, 32]), mixed_step_ratio=0)  # fmt: skip
    use_fake_model(eng.core)
    eng.core.scheduler.proposer = RandomDrafts(rng)
    sessions = [eng.open_session() for _ in range(2)]
    busy: dict[str, str] = {}  # session -> rid of its running turn
    expect: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for _ in range(300):
        if rng.random() < 0.3 and len(eng.core.scheduler.reqs) < 12:
            prompt = [rng.randrange(3, V) for _ in range(rng.randint(1, 30))]
            n = rng.randint(1, 40)
            sid = rng.choice([*sessions, None, None])
            if sid is not None and sid in busy:
                sid = None
            rid = eng.add_request(prompt, {"max_new_tokens": n, "ignore_eos": True},
                                  session_params={"id": sid} if sid else None)  # fmt: skip
            expect[rid] = chain(prompt[-1], n)
            if sid:
                busy[sid] = rid
        live = list(eng.core.scheduler.reqs)
        if live and rng.random() < 0.05:
            rid = rng.choice(live)
            eng.abort(rid)
            aborted.add(rid)
        eng.step()
        eng.core.kv_manager.ledger.check_conservation()
        busy = {s: r for s, r in busy.items() if r in eng.core.scheduler.reqs}
    eng.run_until_idle()
    completed = 0
    for rid, want in expect.items():
        res = eng.result(rid)
        if res["meta_info"]["finish_reason"]["type"] == "abort":  # by us, or a turn too long for the pool
            assert res["output_ids"] == want[: len(res["output_ids"])]
        else:
            assert res["output_ids"] == want, rid
            completed += 1
    assert completed > len(expect) // 2 and aborted
    assert_idle_clean(eng)
