"""Request timeouts and the queued-prefill token budget (issue 33 item 5).

A request past its deadline (its own ``timeout`` or the server's ``request_timeout_s``, the shorter)
ends through the one release path with a 503, as SGLang ends its waiting and running timeouts; what
it generated is kept in its result. Its batch neighbours are unchanged (fp32). The scheduler's clock
is driven by the test so that "queued" and "running" are exact, not a race with a fast tiny model.
"""

from __future__ import annotations

import pytest

from kvledger.errors import OverloadedError, ValidationError
from tests.helpers import assert_idle_clean, step_until

G = {"temperature": 0, "ignore_eos": True}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _engine(make_engine, **kw):
    eng = make_engine(**kw)
    clock = Clock()
    eng.core.scheduler.clock = clock
    return eng, clock


def _ref(make_engine, prompt, n):
    return make_engine().generate(input_ids=prompt, sampling_params={**G, "max_new_tokens": n})["output_ids"]


def test_queued_request_times_out_with_503_and_holds_nothing(make_engine):
    a_prompt, b_prompt = [5, 6, 7, 8] * 5, [9, 10, 11] * 4
    ref_a = _ref(make_engine, a_prompt, 24)
    eng, clock = _engine(make_engine, max_running_requests=1)
    sched = eng.core.scheduler
    a = eng.add_request(a_prompt, {**G, "max_new_tokens": 24})
    b = eng.add_request(b_prompt, {**G, "max_new_tokens": 8, "timeout": 5})
    for _ in range(3):
        eng.step()
    assert [r.rid for r in sched.waiting] == [b] and sched.reqs[b].slot is None  # queued behind a
    clock.t += 5.0
    eng.step()
    res = eng.result(b)
    fr = res["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "in the queue" in fr["message"], fr
    assert res["output_ids"] == []
    assert sched.reqs.get(b) is None and b not in [r.rid for r in sched.waiting]
    eng.run_until_idle()
    assert eng.result(a)["output_ids"] == ref_a  # the running neighbour is unchanged
    assert_idle_clean(eng)


def test_running_request_times_out_keeping_its_output(make_engine):
    long_prompt, nb_prompt = [3, 4, 5] * 7, [7, 8] * 6
    ref_long = _ref(make_engine, long_prompt, 200)
    ref_nb = _ref(make_engine, nb_prompt, 40)
    eng, clock = _engine(make_engine)
    sched = eng.core.scheduler
    rid = eng.add_request(long_prompt, {**G, "max_new_tokens": 200, "timeout": 2.5})
    nb = eng.add_request(nb_prompt, {**G, "max_new_tokens": 40})
    step_until(eng, lambda: len(sched.reqs[rid].output_ids) >= 6)
    clock.t += 2.5
    eng.step()
    res = eng.result(rid)
    fr = res["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "while running" in fr["message"], fr
    out = res["output_ids"]
    assert 6 <= len(out) < 200 and out == ref_long[: len(out)]  # the partial output is kept, and right
    assert res["meta_info"]["completion_tokens"] == len(out)
    st = eng.core.kv_manager.ledger
    assert rid not in sched.reqs and st.audit(count=False).ok
    eng.run_until_idle()
    assert eng.result(nb)["output_ids"] == ref_nb  # the batch neighbour is unchanged
    assert_idle_clean(eng)
    # Its KV was valid: it went to the prefix cache, so a retry of the same prompt finds it.
    again = eng.generate(input_ids=long_prompt, sampling_params={**G, "max_new_tokens": 4})
    assert again["meta_info"]["cached_tokens"] >= 16, again["meta_info"]
    assert again["output_ids"] == ref_long[:4]


def test_error_status_of_a_timeout_is_503(make_engine):
    eng, clock = _engine(make_engine, max_running_requests=1)
    a = eng.add_request([4] * 10, {**G, "max_new_tokens": 30})
    b = eng.add_request([5] * 10, {**G, "max_new_tokens": 4, "timeout": 1})
    eng.step()
    clock.t += 1.0
    outs = []
    while not any(o.rid == b and o.finished for o in outs):
        outs += eng.step()
    fin = next(o for o in outs if o.rid == b and o.finished).finish_reason
    assert (fin.status, fin.code) == (503, "request_timeout")
    err = fin.to_error()
    assert err.status == 503 and err.to_dict()["error"]["code"] == "request_timeout"
    eng.run_until_idle()
    assert eng.result(a)["meta_info"]["finish_reason"]["type"] == "length"
    assert_idle_clean(eng)


def test_server_timeout_applies_and_the_shorter_one_wins(make_engine):
    eng, clock = _engine(make_engine, request_timeout_s=3.0)
    sched = eng.core.scheduler
    plain = eng.add_request([6] * 9, {**G, "max_new_tokens": 300})
    longer = eng.add_request([7] * 9, {**G, "max_new_tokens": 300, "timeout": 100})
    shorter = eng.add_request([8] * 9, {**G, "max_new_tokens": 300, "timeout": 1})
    assert [sched.reqs[r].timeout_s for r in (plain, longer, shorter)] == [3.0, 3.0, 1.0]
    eng.step()
    clock.t += 1.0
    eng.step()
    assert eng.result(shorter)["meta_info"]["finish_reason"]["type"] == "abort"
    assert eng.result(plain) is None and eng.result(longer) is None
    clock.t += 2.0
    eng.step()
    for r in (plain, longer):
        res = eng.result(r)
        fr = res["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and "3 s (the server's --request-timeout-s)" in fr["message"], fr
    assert_idle_clean(eng)


def test_no_timeout_means_no_deadline(make_engine):
    eng, clock = _engine(make_engine)
    rid = eng.add_request([6] * 9, {**G, "max_new_tokens": 5})
    assert eng.core.scheduler.reqs[rid].deadline is None
    clock.t += 10**9
    eng.run_until_idle()
    assert eng.result(rid)["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), 10**12, "5", True, [1]])
def test_bad_timeout_is_refused_before_anything_is_held(make_engine, bad):
    eng = make_engine()
    with pytest.raises(ValidationError) as e:
        eng.add_request([3, 4, 5], {"max_new_tokens": 2, "timeout": bad})
    assert e.value.param == "timeout" and e.value.code == "invalid_value"
    assert not eng.core.scheduler.reqs


def test_queued_prefill_token_budget_refuses_with_429(make_engine):
    eng = make_engine(max_running_requests=1, max_queued_prefill_tokens=40)
    sched = eng.core.scheduler
    first = eng.add_request([3] * 50, {**G, "max_new_tokens": 20})  # alone: taken although > 40
    eng.step()  # admitted: it no longer counts
    w1 = eng.add_request([4] * 25, {**G, "max_new_tokens": 2})
    with pytest.raises(OverloadedError) as e:
        eng.add_request([5] * 16, {**G, "max_new_tokens": 2}, rid="refused")  # 25 + 16 > 40
    assert e.value.status == 429 and e.value.code == "queue_full" and "40" in e.value.message
    assert "refused" not in sched.reqs
    w2 = eng.add_request([5] * 15, {**G, "max_new_tokens": 2})  # 25 + 15 = 40 fits
    eng.run_until_idle()
    for r in (first, w1, w2):
        assert eng.result(r)["meta_info"]["finish_reason"]["type"] == "length"
    assert_idle_clean(eng)


@pytest.mark.parametrize("good", [0.5, 3, 7 * 24 * 3600])
def test_good_timeout_is_taken(make_engine, good):
    eng = make_engine()
    res = eng.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2, "timeout": good})
    assert res["meta_info"]["finish_reason"]["type"] == "length"


def test_timed_out_session_turn_leaves_the_session_as_it_was(make_engine):
    t1, t2, t3 = [5] * 30, list(range(100, 140)), [40, 41, 42]
    ref = make_engine()
    rsid = ref.open_session()
    ref.generate(input_ids=t1, sampling_params={**G, "max_new_tokens": 6}, session_params={"id": rsid})
    want = ref.generate(input_ids=t3, sampling_params={**G, "max_new_tokens": 6}, session_params={"id": rsid})
    ref.close_session(rsid)
    eng, clock = _engine(make_engine)
    sid = eng.open_session()
    eng.generate(input_ids=t1, sampling_params={**G, "max_new_tokens": 6}, session_params={"id": sid})
    held = eng.memory()["kv_session"]
    rid = eng.add_request(t2, {**G, "max_new_tokens": 100, "timeout": 1}, session_params={"id": sid})
    sched = eng.core.scheduler
    step_until(eng, lambda: len(sched.reqs[rid].output_ids) >= 3)
    clock.t += 1.0
    eng.step()
    assert eng.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    assert eng.memory()["kv_session"] == held
    got = eng.generate(input_ids=t3, sampling_params={**G, "max_new_tokens": 6}, session_params={"id": sid})
    assert got["output_ids"] == want["output_ids"]  # as if the timed-out turn never happened
    eng.close_session(sid)
    assert_idle_clean(eng)
