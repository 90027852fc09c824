"""Streaming sessions on the offline engine: exact multi-turn output, and every rule of the seed report."""

from __future__ import annotations

import random
import time

import pytest

from kvledger import ValidationError
from kvledger.errors import ConflictError, NotFoundError, OverloadedError
from tests.helpers import assert_idle_clean

G = {"temperature": 0, "ignore_eos": True}


def _turns(seed: int, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def _reference(eng, turns: list[list[int]], max_new: int) -> list[list[int]]:
    """The same conversation sent as full prompts, without a session (prefix cache off)."""
    history: list[int] = []
    outs = []
    for t in turns:
        prompt = history + t
        o = eng.generate(input_ids=prompt, sampling_params={**G, "max_new_tokens": max_new})["output_ids"]
        outs.append(o)
        history = prompt + o
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
def test_five_turns_equal_full_prompts(make_engine, page_size):
    eng = make_engine(page_size=page_size, chunked_prefill_size=8)  # chunks smaller than a turn
    ref_eng = make_engine(page_size=page_size, enable_prefix_cache=False)
    turns = _turns(page_size)
    refs = _reference(ref_eng, turns, 12)
    sid = eng.open_session()
    prev_len = 0
    for i, (t, ref) in enumerate(zip(turns, refs)):
        out = eng.generate(
            input_ids=t, sampling_params={**G, "max_new_tokens": 12}, session_params={"id": sid}
        )
        assert out["output_ids"] == ref, f"turn {i}"
        meta = out["meta_info"]
        # The previous turns' KV is reused: all of it but the last generated token (its KV is computed
        # by this turn), rounded down to a whole page.
        expect = 0 if i == 0 else (prev_len - 1) // page_size * page_size
        assert meta["cached_tokens"] == expect, (i, meta)
        prev_len = meta["prompt_tokens"] + meta["completion_tokens"]
        m = eng.memory()
        assert m["kv_session"] == -(-(prev_len - 1) // page_size) * page_size
        assert_idle_clean(eng)
    eng.close_session(sid)
    assert eng.memory()["kv_session"] == 0


def test_one_turn_at_a_time(make_engine):
    eng = make_engine()
    sid = eng.open_session()
    rid = eng.add_request([5, 6, 7], {**G, "max_new_tokens": 20}, session_params={"id": sid})
    with pytest.raises(ConflictError) as e:
        eng.add_request([8], {**G, "max_new_tokens": 2}, session_params={"id": sid})
    assert e.value.code == "session_busy"
    eng.run_until_idle()
    assert len(eng.result(rid)["output_ids"]) == 20
    eng.generate(input_ids=[8], sampling_params={**G, "max_new_tokens": 2}, session_params={"id": sid})
    eng.close_session(sid)


def test_close_while_decoding_defers_release(make_engine):
    """Seed 004: closing a session while its turn decodes must not free KV under the scheduler."""
    eng = make_engine()
    sid = eng.open_session()
    eng.generate(
        input_ids=list(range(3, 40)), sampling_params={**G, "max_new_tokens": 5}, session_params={"id": sid}
    )
    rid = eng.add_request([9, 9, 9], {**G, "max_new_tokens": 30}, session_params={"id": sid})
    for _ in range(5):
        eng.step()
    assert eng.memory()["kv_session"] > 0
    eng.close_session(sid)  # deferred: the turn is decoding
    with pytest.raises(NotFoundError):
        eng.add_request([1], {**G, "max_new_tokens": 1}, session_params={"id": sid})
    with pytest.raises(NotFoundError):
        eng.close_session(sid)
    eng.run_until_idle()
    assert len(eng.result(rid)["output_ids"]) == 30  # the turn itself completes
    assert eng.memory()["kv_session"] == 0 and eng.sessions() == []


def test_over_long_turn_leaves_session_intact(make_engine):
    eng = make_engine(max_total_tokens=512, page_size=16)
    ref_eng = make_engine(enable_prefix_cache=False)
    sid = eng.open_session()
    turns = [list(range(3, 200)), [7] * 400, [11, 12, 13]]
    first = eng.generate(
        input_ids=turns[0], sampling_params={**G, "max_new_tokens": 10}, session_params={"id": sid}
    )
    held = eng.memory()["kv_session"]
    with pytest.raises(ValidationError) as e:
        eng.generate(
            input_ids=turns[1], sampling_params={**G, "max_new_tokens": 1}, session_params={"id": sid}
        )
    assert e.value.code == "context_length_exceeded"
    assert eng.memory()["kv_session"] == held
    nxt = eng.generate(
        input_ids=turns[2], sampling_params={**G, "max_new_tokens": 8}, session_params={"id": sid}
    )
    assert nxt["meta_info"]["cached_tokens"] == (len(turns[0]) + 10 - 1) // 16 * 16
    assert [first["output_ids"], nxt["output_ids"]] == [
        *_reference(ref_eng, [turns[0], turns[2]], 10)[:1],
        _reference(ref_eng, [turns[0], turns[2]], 10)[1][:8],
    ]
    eng.close_session(sid)


@pytest.mark.parametrize("when", ["queued", "prefilling", "decoding"])
def test_aborted_turn_never_writes_into_the_session(make_engine, when):
    eng = make_engine(max_running_requests=1, chunked_prefill_size=16)
    ref_eng = make_engine(enable_prefix_cache=False)
    sid = eng.open_session()
    t1, t2, t3 = [5] * 30, list(range(100, 180)), [40, 41, 42]
    r1 = eng.generate(input_ids=t1, sampling_params={**G, "max_new_tokens": 6}, session_params={"id": sid})
    before = eng.sessions()[0]
    blocker = eng.add_request([3] * 5, {**G, "max_new_tokens": 8}) if when == "queued" else None
    eng.step()
    rid = eng.add_request(t2, {**G, "max_new_tokens": 40}, session_params={"id": sid})
    eng.step()
    req = eng.core.scheduler.reqs[rid]
    if when == "prefilling":
        assert 0 < req.kv_len < req.seq_len - 1
    elif when == "decoding":
        while len(req.output_ids) < 3:
            eng.step()
    else:
        assert req.state.value == "waiting"
    eng.abort(rid)  # a client disconnect takes the same path
    eng.step()
    assert eng.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    after = eng.sessions()[0]
    assert (after["tokens"], after["kv_tokens"], after["held_tokens"]) == (
        before["tokens"],
        before["kv_tokens"],
        before["held_tokens"],
    )
    r3 = eng.generate(input_ids=t3, sampling_params={**G, "max_new_tokens": 6}, session_params={"id": sid})
    assert [r1["output_ids"], r3["output_ids"]] == _reference(ref_eng, [t1, t3], 6)
    if blocker:
        eng.run_until_idle()
        eng.result(blocker)
    eng.close_session(sid)


def test_retry_with_shorter_prompt_frees_orphaned_tail(make_engine):
    eng = make_engine(page_size=16)
    ref_eng = make_engine(enable_prefix_cache=False)
    sid = eng.open_session()
    t1, t2, t2b = list(range(3, 60)), list(range(60, 140)), [7, 8, 9]
    a = eng.generate(input_ids=t1, sampling_params={**G, "max_new_tokens": 5}, session_params={"id": sid})
    after_first = len(t1) + 5
    eng.generate(input_ids=t2, sampling_params={**G, "max_new_tokens": 5}, session_params={"id": sid})
    big = eng.memory()["kv_session"]
    # Rewind to after the first turn and go another way.
    b = eng.generate(
        input_ids=t2b,
        sampling_params={**G, "max_new_tokens": 5},
        session_params={"id": sid, "offset": after_first},
    )
    assert eng.memory()["kv_session"] < big
    assert eng.sessions()[0]["tokens"] == after_first + 3 + 5
    assert [a["output_ids"], b["output_ids"]] == _reference(ref_eng, [t1, t2b], 5)
    with pytest.raises(ValidationError):
        eng.generate(input_ids=[1], session_params={"id": sid, "replace": True})
    with pytest.raises(ValidationError):
        eng.generate(input_ids=[1], session_params={"id": sid, "offset": 10**6})
    eng.close_session(sid)


def test_idle_sessions_expire(make_engine):
    eng = make_engine()
    sid = eng.open_session(timeout=0.2)
    keep = eng.open_session(timeout=60)
    for s in (sid, keep):
        eng.generate(
            input_ids=[4, 5, 6], sampling_params={**G, "max_new_tokens": 3}, session_params={"id": s}
        )
    time.sleep(0.3)
    eng.step()
    assert [s["id"] for s in eng.sessions()] == [keep]
    with pytest.raises(NotFoundError):
        eng.generate(input_ids=[1], session_params={"id": sid})
    eng.close_session(keep)


def test_session_cap_and_flood(make_engine):
    eng = make_engine(max_sessions=8, max_total_tokens=1024)
    ids = [eng.open_session() for _ in range(8)]
    with pytest.raises(OverloadedError):
        eng.open_session()
    with pytest.raises(ConflictError):
        eng.close_session(ids[0]) or eng.open_session(ids[1])
    outs = [
        eng.add_request([3 + i] * 20, {**G, "max_new_tokens": 4}, session_params={"id": s})
        for i, s in enumerate(ids[1:])
    ]
    eng.run_until_idle()
    assert all(len(eng.result(r)["output_ids"]) == 4 for r in outs)
    assert eng.memory()["kv_session"] == sum(s["held_tokens"] for s in eng.sessions()) > 0
    for s in ids[1:]:
        eng.close_session(s)
    assert eng.memory()["kv_session"] == 0


def test_sessions_never_starve_a_normal_request(make_engine):
    """Idle sessions' KV is dropped when a normal request needs the pages; they recompute later."""
    eng = make_engine(max_total_tokens=256, page_size=16)
    ref_eng = make_engine(enable_prefix_cache=False)
    sids = [eng.open_session() for _ in range(3)]
    for i, s in enumerate(sids):
        eng.generate(
            input_ids=[10 + i] * 60, sampling_params={**G, "max_new_tokens": 4}, session_params={"id": s}
        )
    assert eng.memory()["kv_session"] >= 192
    big = eng.generate(input_ids=list(range(3, 203)), sampling_params={**G, "max_new_tokens": 40})
    assert len(big["output_ids"]) == 40
    assert eng.core.kv_manager.sessions.evictions > 0
    # An evicted session still answers exactly: its tokens are recomputed.
    out = eng.generate(
        input_ids=[99], sampling_params={**G, "max_new_tokens": 5}, session_params={"id": sids[0]}
    )
    first = ref_eng.generate(input_ids=[10] * 60, sampling_params={**G, "max_new_tokens": 4})["output_ids"]
    ref = ref_eng.generate(input_ids=[10] * 60 + first + [99], sampling_params={**G, "max_new_tokens": 5})
    assert out["output_ids"] == ref["output_ids"]
    for s in sids:
        eng.close_session(s)


def test_sessions_restored_on_a_new_engine_continue_exactly(make_engine):
    """What the front does after an engine restart: its SessionStore's records re-open the sessions
    on a fresh engine, and their next turn equals the full conversation sent as one prompt."""
    from kvledger.common import FinishReason
    from kvledger.server.session_store import SessionStore

    eng, fresh = make_engine(), make_engine()
    ref_eng = make_engine(enable_prefix_cache=False)
    turns = _turns(7, 4)
    refs = _reference(ref_eng, turns, 6)
    store = SessionStore(max_sessions=8, default_timeout_s=None)
    sid = eng.open_session()
    store.opened(sid, None)
    for t in turns[:3]:
        params = {"id": sid}
        out = eng.generate(input_ids=t, sampling_params={**G, "max_new_tokens": 6}, session_params=params)
        store.turn_ended(
            params, t, FinishReason(out["meta_info"]["finish_reason"]["type"]), out["output_ids"]
        )
    # An aborted turn (a crash, a disconnect) leaves the record as it was, as the engine does.
    store.turn_ended({"id": sid}, [9, 9, 9], FinishReason("abort", status=503), [1, 2])
    [engine_view] = eng.sessions()
    assert engine_view["tokens"] == len(store.records[sid].tokens)
    with pytest.raises(ValidationError):
        fresh.restore_sessions([{"id": "bad", "timeout": None, "tokens": [10**9]}])
    assert fresh.sessions() == []
    assert fresh.restore_sessions(store.snapshot()) == 1
    out = fresh.generate(
        input_ids=turns[3], sampling_params={**G, "max_new_tokens": 6}, session_params={"id": sid}
    )
    assert out["output_ids"] == refs[3]
    assert out["meta_info"]["prompt_tokens"] == engine_view["tokens"] + len(turns[3])
    fresh.close_session(sid)
    eng.close_session(sid)


def test_session_store_is_bounded_and_prunes_expired():
    from kvledger.server.session_store import SessionStore

    store = SessionStore(max_sessions=2, default_timeout_s=10.0)
    store.opened("a", None)
    store.opened("b", 0.01)
    time.sleep(0.02)
    store.opened("c", None)  # b expired and was pruned first; nothing else had to go
    assert set(store.records) == {"a", "c"}
    store.opened("d", None)  # over the cap: the least recently used (a) goes
    assert set(store.records) == {"c", "d"}
    store.turn_ended({"id": "c"}, [1, 2], None, [])  # not finished: nothing
    from kvledger.common import FinishReason

    store.turn_ended({"id": "c"}, [1, 2], FinishReason("stop"), [3])
    store.turn_ended({"id": "c", "offset": 1}, [4], FinishReason("length"), [5, 6])
    assert store.records["c"].tokens.tolist() == [1, 4, 5, 6]
    store.turn_ended({"id": "c"}, [7], FinishReason("abort", code="session_not_found", status=404), [])
    assert "c" not in store.records  # the engine no longer has it
