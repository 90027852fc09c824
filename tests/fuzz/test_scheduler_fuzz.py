"""Randomised scheduler fuzz: hundreds of requests through a tiny pool (256 tokens, pages of 16)
with aborts injected in every state and retraction forced; the books balance at every idle point
and every request that was not aborted produces exactly what it produces alone."""

from __future__ import annotations

import random

import pytest

from kvledger import Engine, ValidationError
from kvledger.errors import NotFoundError, OverloadedError
from tests.helpers import FixedCosts, assert_idle_clean

ABORT_STATES = ["none"] * 6 + ["waiting", "mid_prefill", "first_token", "mid_decode", "after_finish"]


def _state_reached(req, state: str) -> bool:
    if req is None:
        return False
    if state == "waiting":
        return req.state.value == "waiting"
    if state == "mid_prefill":
        return req.state.value == "running" and 0 < req.kv_len < len(req.input_ids) - 1 and not req.output_ids
    if state == "first_token":
        return len(req.output_ids) == 1
    if state == "mid_decode":
        return len(req.output_ids) >= 3
    return False


@pytest.mark.parametrize("seed,mixed,paced", [(0, True, False), (1, False, False), (2, False, True)])
def test_scheduler_fuzz(tiny_loaded, seed, mixed, paced):
    rng = random.Random(seed)
    eng = Engine(
        loaded_model=tiny_loaded,
        dtype="float32",
        page_size=16,
        max_total_tokens=256,
        chunked_prefill_size=48,
        max_running_requests=8,
        max_queued_requests=64,
        enable_mixed_chunk=mixed,
        # Pacing by fixed costs (the steps must not depend on this machine's timings): decode steps
        # 10 ms, a prompt token 1 ms, so prompt steps of 13 tokens while requests decode; unpaced, the
        # fixed budget.
        mixed_step_ratio=2.5 if paced else 0,
        strict_memory=True,
    )
    if paced:
        eng.core.scheduler.policy.costs = FixedCosts((0.010, 0.0), (0.002, 0.001), (0.010, 0.001))
    ref = Engine(
        loaded_model=tiny_loaded,
        dtype="float32",
        page_size=16,
        max_total_tokens=4096,
        enable_prefix_cache=False,
        strict_memory=True,
    )
    ctx = eng.core.limits.context_length
    prefixes = [[rng.randrange(3, 256) for _ in range(rng.choice([16, 40, 90]))] for _ in range(4)]
    pending: dict[str, tuple[list[int], int, str]] = {}
    done: dict[str, tuple[list[int], int, dict]] = {}
    counts = {"rejected": 0, "refused": 0, "aborted": 0, "completed": 0}
    total = 520 if seed == 0 else 260
    submitted = 0
    idle_checks = 0
    while submitted < total or pending:
        # Arrivals in bursts, then sometimes a drain to an idle point.
        if submitted < total and rng.random() < 0.5:
            for _ in range(rng.randint(1, 6)):
                if submitted >= total:
                    break
                submitted += 1
                n = rng.choice([1, 2, 5, 17, 33, 70, 120, 200, 255, 256, 300])
                body = [rng.randrange(3, 256) for _ in range(n)]
                prompt = (rng.choice(prefixes) + body)[: max(n, 1)] if rng.random() < 0.5 else body
                max_new = rng.choice([0, 1, 1, 2, 5, 12, 30])
                state = rng.choice(ABORT_STATES)
                try:
                    rid = eng.add_request(
                        prompt, {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
                    )
                except ValidationError as e:
                    assert len(prompt) >= ctx or len(prompt) + max_new > ctx
                    assert e.code == "context_length_exceeded"
                    counts["rejected"] += 1
                    continue
                except OverloadedError:
                    counts["refused"] += 1  # the bounded queue is full: a clear refusal
                    continue
                pending[rid] = (prompt, max_new, state)
                if state == "waiting":
                    eng.abort(rid)  # before the loop ever sees it
        eng.step()
        for rid, (prompt, max_new, state) in list(pending.items()):
            req = eng.core.scheduler.reqs.get(rid)
            if state not in ("none", "after_finish", "waiting") and _state_reached(req, state):
                eng.abort(rid)
            res = eng.result(rid)
            if res is not None:
                del pending[rid]
                done[rid] = (prompt, max_new, res)
                if state == "after_finish":
                    with pytest.raises(NotFoundError):
                        eng.abort(rid)
        if rng.random() < 0.03 or (submitted >= total and not pending):
            eng.run_until_idle()
            for rid in list(pending):
                res = eng.result(rid)
                done[rid] = (*pending.pop(rid)[:2], res)
            assert_idle_clean(eng)
            idle_checks += 1
    assert_idle_clean(eng)
    # Outputs of the requests that were not aborted equal the same request run alone.
    cache: dict[tuple, list[int]] = {}
    for rid, (prompt, max_new, res) in done.items():
        fr = res["meta_info"]["finish_reason"]["type"]
        if fr == "abort":
            counts["aborted"] += 1
            continue
        counts["completed"] += 1
        key = (tuple(prompt), max_new)
        if key not in cache:
            cache[key] = ref.generate(
                input_ids=prompt,
                sampling_params={"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
            )["output_ids"]
        expect = cache[key][:max_new]  # a max_new_tokens beyond the context was refused above
        assert res["output_ids"] == expect, f"{rid}: prompt {len(prompt)} max_new {max_new}"
    print(counts, "retractions", eng.core.scheduler.total_retractions, "idle checks", idle_checks)
    assert counts["completed"] > total // 3 and counts["aborted"] > 10 and counts["rejected"] > 0
    assert eng.core.scheduler.total_retractions > 0, "the tiny pool must force retraction"
    assert idle_checks >= 3
    assert_idle_clean(ref)
