"""Priority scheduling and the schedule policies (fcfs, lpm, dfs-weight) on the offline engine, fp32.

A preempted request goes back to waiting through the retraction path and its output equals the same
request run alone, token for token; a preempted session turn leaves its session as it was."""

from __future__ import annotations

import pytest

from kvledger.errors import ServiceUnavailable, ValidationError
from tests.helpers import step_until

G = {"temperature": 0.0, "ignore_eos": True}
LOW = list(range(3, 40))
HIGH = list(range(50, 70))


def _alone(make_engine, ids, n, **kw):
    eng = make_engine(**kw)
    return eng.generate(input_ids=ids, sampling_params={**G, "max_new_tokens": n})["output_ids"]


def _running(eng) -> list[str]:
    return [r.rid for r in eng.core.scheduler.running]


@pytest.mark.parametrize("mixed", [False, True])
def test_high_priority_preempts_a_decoding_request_whose_output_is_unchanged(make_engine, mixed):
    """One running slot: a low-priority greedy request decodes; a high-priority one arrives, retracts
    it (the slot is full), runs to its end, then the low one resumes. Both equal their runs alone."""
    kw = dict(max_running_requests=1, enable_mixed_chunk=mixed)
    low_alone = _alone(make_engine, LOW, 30, **kw)
    high_alone = _alone(make_engine, HIGH, 8, **kw)
    eng = make_engine(enable_priority_scheduling=True, **kw)
    low = eng.add_request(LOW, {**G, "max_new_tokens": 30, "priority": 0}, rid="low")
    step_until(eng, lambda: len(eng.core.scheduler.reqs["low"].output_ids) >= 10)  # mid-decode
    high = eng.add_request(HIGH, {**G, "max_new_tokens": 8, "priority": 100}, rid="high")
    eng.step()
    assert _running(eng) == ["high"]  # preempted at once
    assert eng.core.scheduler.policy.total_preemptions == 1
    eng.run_until_idle()
    assert eng.result(high)["output_ids"] == high_alone
    res = eng.result(low)
    assert res["output_ids"] == low_alone
    assert res["meta_info"]["finish_reason"]["type"] == "length"


def test_preemption_when_the_pool_is_full(make_engine):
    """Slots to spare, but a pool too small for both: the arrival retracts the running request for
    its pages."""
    kw = dict(page_size=4, max_total_tokens=96, max_running_requests=4)
    low_alone = _alone(make_engine, LOW, 40, **kw)
    eng = make_engine(enable_priority_scheduling=True, **kw)
    eng.add_request(LOW, {**G, "max_new_tokens": 40, "priority": 1}, rid="low")
    step_until(eng, lambda: len(eng.core.scheduler.reqs["low"].output_ids) >= 20)
    eng.add_request(list(range(60, 100)), {**G, "max_new_tokens": 4, "priority": 50}, rid="high")
    eng.step()
    assert "high" in _running(eng) and "low" not in _running(eng)
    eng.run_until_idle()
    assert eng.result("low")["output_ids"] == low_alone
    assert eng.result("high")["meta_info"]["finish_reason"]["type"] == "length"


def test_no_preemption_within_the_threshold_or_without_the_flag(make_engine):
    """A priority higher by the threshold or less (default 10) waits; so does any priority without
    --enable-priority-scheduling (ignored, as SGLang)."""
    for flags, hi in (({"enable_priority_scheduling": True}, 10), ({}, 1000)):
        eng = make_engine(max_running_requests=1, **flags)
        eng.add_request(LOW, {**G, "max_new_tokens": 12, "priority": 0}, rid="low")
        step_until(eng, lambda e=eng: len(e.core.scheduler.reqs["low"].output_ids) >= 3)
        eng.add_request(HIGH, {**G, "max_new_tokens": 2, "priority": hi}, rid="high")
        eng.step()
        assert _running(eng) == ["low"]
        eng.run_until_idle()
        assert eng.core.scheduler.policy.total_preemptions == 0
        assert eng.core.scheduler.total_retractions == 0
        eng.result("low"), eng.result("high")


def test_low_priority_values_first_and_a_request_without_priority(make_engine):
    """--schedule-low-priority-values-first: priority 0 preempts priority 50; a request without a
    priority is the least important (preempted by any, preempts none)."""
    eng = make_engine(max_running_requests=1, enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    eng.add_request(LOW, {**G, "max_new_tokens": 12}, rid="none")  # no priority
    step_until(eng, lambda: len(eng.core.scheduler.reqs["none"].output_ids) >= 2)
    eng.add_request(HIGH, {**G, "max_new_tokens": 12, "priority": 50}, rid="p50")
    eng.step()
    assert _running(eng) == ["p50"]
    step_until(eng, lambda: len(eng.core.scheduler.reqs["p50"].output_ids) >= 2)
    eng.add_request([7] * 9, {**G, "max_new_tokens": 2, "priority": 0}, rid="p0")
    eng.step()
    assert _running(eng) == ["p0"]
    assert eng.core.scheduler.policy.total_preemptions == 2
    eng.run_until_idle()
    for rid in ("none", "p50", "p0"):
        assert eng.result(rid)["meta_info"]["finish_reason"]["type"] == "length"


def test_queue_order_is_priority_then_arrival(make_engine):
    """Nothing running can be preempted (threshold): the queue is served by priority, then arrival."""
    eng = make_engine(max_running_requests=1, enable_priority_scheduling=True,
                      priority_scheduling_preemption_threshold=1000)  # fmt: skip
    eng.add_request([5] * 9, {**G, "max_new_tokens": 3, "priority": 0}, rid="first")
    eng.step()
    for rid, p in (("a", 1), ("b", 5), ("c", 1), ("d", 5), ("e", None)):
        eng.add_request([6] * 9, {**G, "max_new_tokens": 2, "priority": p}, rid=rid)
    admitted: list[str] = []
    while not eng.core.scheduler.idle:
        eng.step()
        for r in eng.core.scheduler.running:
            if r.rid not in admitted and r.rid != "first":
                admitted.append(r.rid)
    assert admitted == ["b", "d", "a", "c", "e"]
    for rid in ("first", "a", "b", "c", "d", "e"):
        eng.result(rid)


def test_preempted_session_turn_leaves_its_session_as_before(make_engine):
    """A session turn preempted mid-decode frees only its own pages (the session keeps the KV of its
    earlier turns, exactly), then resumes and completes with the output it has alone."""
    kw = dict(max_running_requests=1)
    ref = make_engine(**kw)
    sid = ref.open_session()
    ref.generate(input_ids=LOW, sampling_params={**G, "max_new_tokens": 5}, session_params={"id": sid})
    want = ref.generate(input_ids=[9, 9, 9], sampling_params={**G, "max_new_tokens": 20},
                        session_params={"id": sid})["output_ids"]  # fmt: skip
    ref.close_session(sid)

    eng = make_engine(enable_priority_scheduling=True, **kw)
    sid = eng.open_session()
    eng.generate(input_ids=LOW, sampling_params={**G, "max_new_tokens": 5}, session_params={"id": sid})
    sess = eng.core.sessions.sessions[sid]
    held = eng.memory()["kv_session"]
    before = (list(sess.tokens), list(sess.pages), sess.kv_len)
    eng.add_request([9, 9, 9], {**G, "max_new_tokens": 20, "priority": 0}, rid="turn", session_params={"id": sid})
    step_until(eng, lambda: len(eng.core.scheduler.reqs["turn"].output_ids) >= 6)
    eng.add_request(HIGH, {**G, "max_new_tokens": 6, "priority": 99}, rid="high")
    eng.step()
    assert _running(eng) == ["high"]
    assert eng.memory()["kv_session"] == held  # the session's KV untouched by the preempted turn
    assert (list(sess.tokens), list(sess.pages), sess.kv_len) == before
    eng.run_until_idle()
    assert eng.result("turn")["output_ids"] == want
    eng.result("high")
    eng.close_session(sid)


def test_priority_is_validated_and_can_be_refused_when_disabled(make_engine):
    eng = make_engine()
    for bad in ("5", 1.5, True, 2**63):
        with pytest.raises(ValidationError) as e:
            eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1, "priority": bad})
        assert e.value.param == "priority"
    strict = make_engine(abort_on_priority_when_disabled=True)
    with pytest.raises(ServiceUnavailable) as e:
        strict.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1, "priority": 3})
    assert e.value.code == "priority_disabled"
    assert strict.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})["output_ids"]


def _shared_prefix_prompts():
    """Two groups of four prompts over two 48-token prefixes, interleaved in arrival order."""
    a, b = list(range(100, 148)), list(range(160, 208))
    return [(a if i % 2 == 0 else b) + [220 + i, 221 + i] for i in range(8)]


def test_lpm_serves_the_longest_cached_prefix_first(make_engine):
    """With prefix b cached, lpm admits b's requests before a's (arrival order alternates)."""
    eng = make_engine(max_running_requests=1, schedule_policy="lpm")
    prompts = _shared_prefix_prompts()
    eng.generate(input_ids=prompts[1], sampling_params={**G, "max_new_tokens": 1})  # caches prefix b
    eng.add_request([1] * 5, {**G, "max_new_tokens": 4}, rid="busy")
    eng.step()
    rids = [eng.add_request(p, {**G, "max_new_tokens": 2}, rid=f"r{i}") for i, p in enumerate(prompts)]
    order: list[str] = []
    while not eng.core.scheduler.idle:
        eng.step()
        order += [r.rid for r in eng.core.scheduler.running if r.rid not in order and r.rid != "busy"]
    assert order[:4] == ["r1", "r3", "r5", "r7"]
    for rid in [*rids, "busy"]:
        eng.result(rid)


def test_dfs_weight_groups_each_subtree(make_engine):
    """dfs-weight: the heavier cached subtree's requests together first, then the other's."""
    eng = make_engine(max_running_requests=1, schedule_policy="dfs-weight")
    prompts = _shared_prefix_prompts()
    for p in prompts[:2]:
        eng.generate(input_ids=p, sampling_params={**G, "max_new_tokens": 1})  # both prefixes cached
    eng.add_request([1] * 5, {**G, "max_new_tokens": 4}, rid="busy")
    eng.step()
    extra_b = [*range(160, 208), 240, 241]
    rids = [eng.add_request(p, {**G, "max_new_tokens": 2}, rid=f"r{i}") for i, p in enumerate(prompts)]
    rids.append(eng.add_request(extra_b, {**G, "max_new_tokens": 2}, rid="rb"))  # b's subtree: 5 waiting
    sched = eng.core.scheduler
    sched.policy.order.sort(sched.waiting)  # what the next step does first (the order then moves on)
    assert [r.rid for r in sched.waiting] == ["r1", "r3", "r5", "r7", "rb", "r0", "r2", "r4", "r6"]
    eng.run_until_idle()
    for rid in [*rids, "busy"]:
        eng.result(rid)


def test_schedule_policy_outputs_equal_fcfs(make_engine):
    """Order changes nothing in what each request generates (fp32, greedy)."""
    prompts = _shared_prefix_prompts()
    outs = {}
    for policy in ("fcfs", "lpm", "dfs-weight"):
        eng = make_engine(max_running_requests=2, schedule_policy=policy, enable_priority_scheduling=True)
        res = eng.generate(input_ids=prompts, sampling_params=[{**G, "max_new_tokens": 6, "priority": i % 3}
                                                               for i in range(len(prompts))])  # fmt: skip
        outs[policy] = [r["output_ids"] for r in res]
    assert outs["lpm"] == outs["fcfs"] == outs["dfs-weight"]


def test_peek_matches_what_match_prefix_would_and_changes_nothing(make_engine):
    """lpm and dfs-weight read the tree every step: a peek must not split nodes, touch access times
    or hit counts (eviction order and write_through_selective depend on them)."""
    eng = make_engine()
    prompts = _shared_prefix_prompts()
    eng.generate(input_ids=prompts[:2], sampling_params={**G, "max_new_tokens": 1})
    tree = eng.core.kv_manager.tree

    def snapshot():
        return sorted((n.id, len(n.key), n.last_access, n.hit_count) for n in tree.nodes())

    before = snapshot()
    probe = prompts[2][:40] + [9] * 30  # diverges inside a cached node: match_prefix would split it
    n = tree.peek(probe)[0]
    assert snapshot() == before
    pages = tree.match_prefix(probe)[0]
    assert n == len(pages) * tree.page_size == 32 and snapshot() != before
    assert tree.peek(prompts[4])[0] == 48
