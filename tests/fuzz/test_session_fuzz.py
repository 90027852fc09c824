"""Randomised sessions under a tiny pool that forces retraction and eviction: many sessions, random
turns, aborts, closes, rewinds and expiries. The books balance at every step (strict mode) and at every
idle point, and every completed turn equals the same conversation sent as one full prompt."""

from __future__ import annotations

import contextlib
import random
import time

import pytest

from kvledger import Engine, ValidationError
from kvledger.errors import ConflictError, NotFoundError, OverloadedError
from tests.helpers import assert_idle_clean

G = {"temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("seed,page_size", [(0, 16), (1, 1)])
def test_session_fuzz(tiny_loaded, seed, page_size):
    rng = random.Random(seed)
    eng = Engine(
        loaded_model=tiny_loaded,
        dtype="float32",
        page_size=page_size,
        max_total_tokens=320,
        chunked_prefill_size=24,
        max_running_requests=4,
        max_sessions=6,
        strict_memory=True,
        enable_mixed_chunk=seed == 0,
    )
    ref = Engine(
        loaded_model=tiny_loaded,
        dtype="float32",
        page_size=16,
        max_total_tokens=4096,
        enable_prefix_cache=False,
    )
    ctx = eng.core.limits.context_length
    history: dict[str, list[int]] = {}  # what each live session's conversation is, per completed turns
    live: dict[str, tuple[str, list[int]]] = {}  # rid -> (session, expected prompt)
    checks = {"completed": 0, "aborted": 0, "closed_busy": 0, "expired": 0, "rewound": 0, "normal": 0}

    def collect() -> None:
        for rid in list(live):
            res = eng.result(rid)
            if res is None:
                continue
            sid, prompt = live.pop(rid)
            if not sid:
                continue
            if res["meta_info"]["finish_reason"]["type"] == "abort":
                checks["aborted"] += 1
                continue
            if sid in history:
                n = len(res["output_ids"])
                expect = ref.generate(input_ids=prompt, sampling_params={**G, "max_new_tokens": n})[
                    "output_ids"
                ]
                assert res["output_ids"] == expect, (sid, len(prompt), res["meta_info"])
                assert res["meta_info"]["prompt_tokens"] == len(prompt)
                history[sid] = prompt + res["output_ids"]
                checks["completed"] += 1

    for step in range(900):
        r = rng.random()
        if r < 0.06 and len(history) < 6:
            timeout = 0.05 if rng.random() < 0.2 else None
            try:
                sid = eng.open_session(timeout=timeout)
            except OverloadedError:
                continue
            history[sid] = []
        elif r < 0.40 and history:
            sid = rng.choice(list(history))
            new = [rng.randrange(3, 256) for _ in range(rng.randint(1, 50))]
            params = {"id": sid}
            base = history[sid]
            if base and rng.random() < 0.15:
                params["offset"] = rng.randint(0, len(base))
                base = base[: params["offset"]]
                checks["rewound"] += 1
            try:
                rid = eng.add_request(
                    new, {**G, "max_new_tokens": rng.choice([1, 3, 8, 20])}, session_params=params
                )
            except (ConflictError, NotFoundError) as e:
                assert isinstance(e, ConflictError) or sid not in [s["id"] for s in eng.sessions()]
                continue
            except ValidationError as e:
                assert e.code == "context_length_exceeded" and len(base) + len(new) >= ctx
                continue
            live[rid] = (sid, base + new)
        elif r < 0.45 and live:
            eng.abort(rng.choice(list(live)))
        elif r < 0.48 and history:
            sid = rng.choice(list(history))
            busy = any(s == sid for s, _ in live.values())
            with contextlib.suppress(NotFoundError):
                eng.close_session(sid)
            checks["closed_busy"] += busy
            history.pop(sid)
        elif r < 0.52:
            rid = eng.add_request(
                [rng.randrange(3, 256) for _ in range(rng.randint(20, 150))], {**G, "max_new_tokens": 10}
            )
            live[rid] = ("", [])
            checks["normal"] += 1
        eng.step()
        collect()
        for sid in list(history):
            if sid not in {s["id"] for s in eng.sessions()}:
                history.pop(sid)
                checks["expired"] += 1
        if step % 150 == 149:
            eng.run_until_idle()
            collect()
            assert not live
            assert_idle_clean(eng)
            time.sleep(0.06)  # let short-timeout sessions expire
    eng.run_until_idle()
    for sid in [s["id"] for s in eng.sessions()]:
        eng.close_session(sid)
    assert_idle_clean(eng)
    assert eng.memory()["kv_session"] == 0
    assert checks["completed"] > 30 and checks["aborted"] > 3 and checks["rewound"] > 3, checks
    assert eng.core.scheduler.total_retractions + eng.core.kv_manager.sessions.evictions > 0, checks
