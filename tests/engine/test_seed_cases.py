"""The bug reports in shared/seeds/ as named tests, plus the production-mode leak path."""

from __future__ import annotations

import pytest

from kvledger import ValidationError
from kvledger.common.disagg import DisaggParams
from kvledger.common.health import HEALTH_CHECK_IDS, HEALTH_CHECK_SAMPLING, health_check_disagg
from kvledger.errors import NotFoundError
from tests import combos
from tests.helpers import assert_idle_clean

GREEDY = {"temperature": 0, "ignore_eos": True}


def _with(*features: str) -> combos.Row | None:
    """The configuration of ``features`` in fp32 (where the table allows it: outputs then compare
    with the plain engine's), or None where the table refuses them together."""
    row = set(features)
    if not combos.compatible(row) or not set(row) <= set(combos.runnable_here()):
        return None
    return frozenset(row | ({"fp32"} if combos.compatible(row | {"fp32"}) else set()))


def _rows(*candidates: tuple[str, ...]) -> list[combos.Row]:
    """The candidates the table allows, at run time: a pair lifted from ``compat.REFUSED`` joins."""
    return [r for r in (_with(*c) for c in candidates) if r is not None]


# Seed 000 with speculation, with TP and with the hierarchy.
SEED_000 = _rows(*[("mixed_chunk", *x) for x in [(), ("draft",), ("ngram",), ("tp",), ("hicache",)]])
# Seed 004 (speculation's over-allocation handed to a session) with TP and with the hierarchy.
SEED_004 = _rows(
    *[(spec, *x, "sessions") for spec in ("draft", "ngram") for x in [(), ("tp",), ("hicache",)]]
)
# Every configuration of the table's covering array (tests/combos.py) this machine runs.
ROWS = combos.covering_array()
SESSION_ROWS = [r for r in ROWS if "sessions" in r]


@pytest.fixture
def start_combo(tiny_llama, tiny_loaded, tmp_path):
    """``start_combo(row, **settings)``: the engine(s) of a configuration on the tiny Llama (the draft
    model: the target itself), audited clean at teardown, then shut down (TP workers gone)."""
    started = []

    def start(row, **kw):
        s = combos.start(frozenset(row), tiny_llama, tiny_loaded, tiny_llama, str(tmp_path), **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        try:
            for eng in s.engines:
                if s.pd:
                    eng.core.disagg_connector.timeout_s = 0.2  # a failed test must not wait out a transfer
                assert_idle_clean(eng)
        finally:
            s.shutdown()


def _step_until(eng, cond, limit=500):
    eng.step()  # take submitted requests in
    for _ in range(limit):
        if cond():
            return
        eng.step()
    raise AssertionError("condition never reached")


def _live(eng, rid):
    return eng.core.scheduler.reqs.get(rid)


@pytest.mark.parametrize("row", SEED_000, ids=combos.row_id)
def test_finish_in_first_mixed_prefill_chunk(start_combo, make_engine, row):
    """Seed 000: max_new_tokens=1 with mixed chunks finishes in the forward of its only prefill chunk
    (beside three decodes: with speculation, their drafts), and frees its slot at once; under each
    combination the table allows with mixed chunks (speculation, TP, the hierarchy)."""
    # (No pacing: the mixed forward's size must not depend on this machine's step timings.)
    eng = start_combo(row, chunked_prefill_size=64, mixed_step_ratio=0).engines[0]
    runners = [eng.add_request([5 + i] * 20, {**GREEDY, "max_new_tokens": 30}) for i in range(3)]
    _step_until(eng, lambda: all(len(_live(eng, r).output_ids) >= 2 for r in runners))
    one = eng.add_request(list(range(3, 43)), {**GREEDY, "max_new_tokens": 1})
    eng.step()
    stats = eng.core.scheduler.last_stats
    assert stats.num_decode == 3 and stats.num_prefill_tokens == 40  # a mixed forward
    res = eng.result(one)
    assert res is not None and res["meta_info"]["finish_reason"]["type"] == "length"
    assert len(res["output_ids"]) == 1
    m = eng.memory()
    assert m["req_slots_total"] - m["req_slots_free"] == 3  # only the three runners hold slots
    eng.run_until_idle()
    outs = [eng.result(r)["output_ids"] for r in runners]
    ref = make_engine(enable_prefix_cache=False)
    sps = [{**GREEDY, "max_new_tokens": 30}] * 3 + [{**GREEDY, "max_new_tokens": 1}]
    want = ref.generate(
        input_ids=[[5 + i] * 20 for i in range(3)] + [list(range(3, 43))], sampling_params=sps
    )
    assert [*outs, res["output_ids"]] == [w["output_ids"] for w in want]
    if row & {"draft", "ngram"}:
        assert eng.core.scheduler.spec_totals.verify_ct > 0


def test_over_long_input_rejected_while_others_run(make_engine):
    """Seed 000 (second report): an over-long input is refused up front and allocates nothing."""
    eng = make_engine(max_total_tokens=512)
    runner = eng.add_request([7] * 50, {**GREEDY, "max_new_tokens": 40})
    eng.step()
    before = eng.memory()
    ctx = eng.core.limits.context_length
    for n in (ctx, ctx + 1, 40957):
        with pytest.raises(ValidationError) as e:
            eng.generate(input_ids=[1] * n, sampling_params={"max_new_tokens": 1})
        assert e.value.code == "context_length_exceeded"
    assert eng.memory() == before
    eng.run_until_idle()
    assert len(eng.result(runner)["output_ids"]) == 40


def test_prompt_plus_max_tokens_over_context(make_engine):
    """An explicit max_new_tokens that does not fit is refused (as SGLang); the default is clamped."""
    eng = make_engine(max_total_tokens=256)
    before = eng.memory()
    with pytest.raises(ValidationError) as e:
        eng.generate(input_ids=[9] * 250, sampling_params={**GREEDY, "max_new_tokens": 100})
    assert e.value.code == "context_length_exceeded" and "250 in the prompt, 100 in the completion" in str(e.value)
    assert eng.memory() == before
    out = eng.generate(input_ids=[9] * 250, sampling_params={**GREEDY, "ignore_eos": True})
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("same_step", [False, True])
def test_abort_between_last_prefill_chunk_and_first_token(make_engine, same_step):
    eng = make_engine(chunked_prefill_size=16)
    rid = eng.add_request(list(range(3, 53)), {**GREEDY, "max_new_tokens": 20})
    if same_step:
        # The abort arrives while the last chunk is due: it must win before the chunk runs.
        _step_until(eng, lambda: _live(eng, rid).seq_len - _live(eng, rid).kv_len <= 16)
        eng.abort(rid)
        eng.step()
    else:
        _step_until(eng, lambda: len(_live(eng, rid).output_ids) == 1)  # prefill done, 1st token out
        eng.abort(rid)
        eng.step()
    res = eng.result(rid)
    assert res["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(res["output_ids"]) <= 1


def test_abort_while_waiting_allocates_nothing(make_engine):
    eng = make_engine(max_running_requests=2)
    runners = [eng.add_request([4 + i] * 30, {**GREEDY, "max_new_tokens": 10}) for i in range(2)]
    eng.step()
    waiting = eng.add_request([9] * 30, {**GREEDY, "max_new_tokens": 10})
    eng.step()
    req = _live(eng, waiting)
    assert req.state.value == "waiting" and req.slot is None
    eng.abort(waiting)
    eng.step()
    assert eng.result(waiting)["meta_info"]["finish_reason"]["type"] == "abort"
    eng.run_until_idle()
    assert all(eng.result(r) for r in runners)


def test_abort_after_finish_and_unknown_rid(make_engine):
    eng = make_engine()
    out = eng.generate(input_ids=[3, 4, 5], sampling_params={**GREEDY, "max_new_tokens": 2}, rid="done")
    assert out["meta_info"]["id"] == "done"
    with pytest.raises(NotFoundError):
        eng.abort("done")
    with pytest.raises(NotFoundError):
        eng.abort("never-existed")


def test_max_new_tokens_zero_and_one(make_engine):
    eng = make_engine()
    zero = eng.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"
    one = eng.generate(input_ids=[3, 4, 5], sampling_params={**GREEDY, "max_new_tokens": 1})
    assert len(one["output_ids"]) == 1


def test_closing_a_stream_early_aborts_through_the_release_path(make_engine):
    eng = make_engine()
    it = eng.generate(
        input_ids=list(range(3, 40)), sampling_params={**GREEDY, "max_new_tokens": 50}, stream=True
    )
    first = next(it)
    assert len(first["output_ids"]) == 1
    it.close()
    assert not eng.core.scheduler.reqs


def test_retraction_keeps_output_unchanged(make_engine, tiny_loaded):
    from kvledger import Engine

    prompts = [[3 + i] * (40 + 7 * i) for i in range(6)]
    sp = {**GREEDY, "max_new_tokens": 60}
    ref_eng = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=8192, strict_memory=True)
    refs = [ref_eng.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    eng = make_engine(max_total_tokens=256, page_size=16, chunked_prefill_size=64)
    outs = eng.generate(input_ids=prompts, sampling_params=sp)
    assert eng.core.scheduler.total_retractions > 0, "the pool must be small enough to force retraction"
    assert [o["output_ids"] for o in outs] == refs
    assert_idle_clean(ref_eng)


def test_production_mode_leak_is_reported_quarantined_and_serving_goes_on(tiny_loaded):
    """Production mode: the leaked page is logged and counted, held aside (quarantined: not handed to
    the next request), and freed by the audit after the requests live when it was found have ended."""
    from kvledger import Engine

    eng = Engine(
        loaded_model=tiny_loaded, dtype="float32", max_total_tokens=1024, page_size=16, strict_memory=False
    )
    pool = eng.core.kv_manager.pages
    real_free = pool.free
    dropped = []

    def leaky_free(pages, by):  # lose one page, once
        if not dropped and pages:
            dropped.append(pages[0])
            pages = pages[1:]
        return real_free(pages, by)

    pool.free = leaky_free
    eng.generate(input_ids=list(range(3, 30)), sampling_params={**GREEDY, "max_new_tokens": 5})
    pool.free = real_free
    assert dropped
    lc = eng.memory()["leak_check"]
    assert lc["violations"] == 1 and not lc["ok"] and lc["quarantined_pages_total"] == 1
    assert eng.memory()["kv_quarantined"] == 16 and not pool.is_free(dropped[0])
    rid = eng.add_request(list(range(3, 30)), {**GREEDY, "max_new_tokens": 5})
    eng.step()
    assert dropped[0] not in eng.core.scheduler.running[0].pages  # never handed out while quarantined
    eng.run_until_idle()
    assert len(eng.result(rid)["output_ids"]) == 5
    assert eng.core.kv_manager.ledger.reclaimed_pages == 1 and pool.is_free(dropped[0])
    assert eng.memory()["kv_quarantined"] == 0
    assert eng.audit().ok


def test_duplicate_rid_is_refused_before_anything_is_held(make_engine):
    """A second submission with a running request's rid is refused (409) by the engine's one
    duplicate check, before it holds a slot, a page or a session's turn; the first is untouched."""
    from kvledger.errors import ConflictError

    eng = make_engine()
    sid = eng.open_session()
    first = eng.core.make_request([3, 4, 5], {**GREEDY, "max_new_tokens": 6}, "same")
    second = eng.core.make_request([6, 7], {**GREEDY, "max_new_tokens": 6}, "same")
    eng.core.submit(first)
    eng.core.step()
    before = eng.memory()
    with pytest.raises(ConflictError) as e:
        eng.core.submit(second, {"id": sid})  # bypasses the front's check, as a race would
    assert e.value.code == "duplicate_rid"
    assert eng.memory() == before
    assert eng.sessions()[0]["busy_rid"] is None  # the refused turn never took its session
    assert eng.core.scheduler.reqs.get("same") is first
    while eng.core.scheduler.reqs:
        eng.core.step()
    assert len(first.output_ids) == 6


def test_busy_engine_is_audited_at_its_interval(make_engine):
    """A full audit at a safe point every audit_interval_s while requests run, not only when idle;
    counted in leak_check with its cost."""
    import time

    eng = make_engine(audit_interval_s=0.05, page_size=1)
    rid = eng.add_request([5, 6, 7], {**GREEDY, "max_new_tokens": 900})
    t0 = time.monotonic()
    busy_checks = 0
    while eng.result(rid, pop=False) is None:
        before = eng.memory()["leak_check"]["checks"]
        eng.step()
        if not eng.core.scheduler.idle:
            busy_checks += eng.memory()["leak_check"]["checks"] - before
    elapsed = time.monotonic() - t0
    lc = eng.memory()["leak_check"]
    assert busy_checks >= min(3, int(elapsed / 0.05) // 2), (busy_checks, elapsed)
    cost = eng.memory()["audit"]
    assert lc["ok"] and cost["last_ms"] > 0 and cost["seconds_total"] > 0
    quiet = make_engine(audit_interval_s=0)
    q = quiet.add_request([5, 6, 7], {**GREEDY, "max_new_tokens": 200})
    while quiet.result(q, pop=False) is None:
        quiet.step()
        if not quiet.core.scheduler.idle:
            assert quiet.memory()["leak_check"]["checks"] == 0  # 0: only when idle


# -- the seeds under each combination they apply to (issue 30) -----------------------------------------


def _reference_turns(ref, turns: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """A conversation's turns sent as whole prompts to the plain engine."""
    history: list[int] = []
    outs = []
    for t, n in zip(turns, max_new):
        prompt = history + t
        outs.append(
            ref.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n})["output_ids"]
        )
        history = prompt + outs[-1]
    return outs


@pytest.mark.parametrize("row", SEED_004, ids=combos.row_id)
def test_speculative_tail_is_trimmed_before_a_session_takes_the_turn(start_combo, make_engine, row):
    """Seed 004: a session turn under speculation ends in a step whose drafts had pages allocated
    ahead; the session takes only the pages of its computed KV (the partial last one included), never
    the lookahead, and its next turn reads exactly that KV -- with TP and with the hierarchy."""
    started = start_combo(row, page_size=4)
    eng = started.engines[0]
    sid = eng.open_session()
    turns, max_new = [[5, 6, 7] * 8, [5, 6, 7, 5], [9] * 11], [13, 10, 7]  # runs of drafts overshoot the end
    outs = []
    for t, n in zip(turns, max_new):
        outs.append(eng.generate(input_ids=t, sampling_params={**GREEDY, "max_new_tokens": n},
                                 session_params={"id": sid})["output_ids"])  # fmt: skip
        s = eng.core.sessions.sessions[sid]
        assert s.kv_len == len(s.tokens) - 1  # every token's KV but the newest's
        assert len(s.pages) == -(-s.kv_len // 4), (len(s.pages), s.kv_len)  # no lookahead page kept
        assert_idle_clean(eng)
    assert eng.core.scheduler.spec_totals.drafted > 0
    if combos.exact(row):
        assert outs == _reference_turns(make_engine(enable_prefix_cache=False), turns, max_new)
    eng.close_session(sid)
    assert eng.memory()["kv_session"] == 0


def test_the_books_see_a_page_beyond_a_sessions_kv(make_engine):
    """Seed 004 for every test, not only the one above: the audit checks that a session holds exactly
    its KV's pages. A page more (the shape of a speculative tail handed over with the turn, which
    conservation alone cannot see: the page is owned) is a violation naming the session."""
    eng = make_engine(page_size=4)
    sid = eng.open_session()
    sp = {**GREEDY, "max_new_tokens": 4}
    eng.generate(input_ids=[5, 6, 7] * 3, sampling_params=sp, session_params={"id": sid})
    assert eng.core.kv_manager.ledger.audit(count=False).ok
    s = eng.core.sessions.sessions[sid]
    tail = eng.core.kv_manager.pages.alloc(1, s.owner)
    s.pages.append(tail[0])
    report = eng.core.kv_manager.ledger.audit(count=False)
    assert not report.leaked_pages and not report.double_pages
    said = f"session {sid} holds {len(s.pages)} pages for KV of {s.kv_len} tokens"
    assert any(said in p for p in report.problems), report.describe()
    s.pages.pop()
    eng.core.kv_manager.pages.free(tail, s.owner)
    eng.close_session(sid)
    assert_idle_clean(eng)


def _pd_room(started, n: int):
    return DisaggParams("127.0.0.1", started.port, n)


@pytest.mark.parametrize("row", ROWS, ids=combos.row_id)
def test_health_check_under_each_combination(start_combo, make_engine, row):
    """/health_generate's request (``common/health.py``) while other requests decode, under every
    configuration of the table's covering array: it ends with one token through the one release path
    (every hook called; on a PD pair the fake room: decode's "prebuilt" path, seed 003, and nothing
    moves), the others are untouched, the books are clean after."""
    started = start_combo(row)
    engines = started.engines
    called: list[str] = []
    engines[-1].core.scheduler.release_hooks.append(lambda r: called.append(r.rid))
    prompts = [[5 + i] * (12 + 9 * i) for i in range(3)]
    sp = {**GREEDY, "max_new_tokens": 12}
    for i, p in enumerate(prompts):
        for eng in engines:
            eng.add_request(p, sp, rid=f"r{i}", disagg=_pd_room(started, i + 1) if started.pd else None)
    dec = engines[-1]
    for _ in range(2000):  # r0 decodes (on a PD pair: its KV came from prefill)
        for eng in engines:
            eng.step()
        if _live(dec, "r0") is not None and len(_live(dec, "r0").output_ids) >= 2:
            break
    else:
        raise AssertionError("r0 never decoded")
    for eng in engines:
        eng.add_request(list(HEALTH_CHECK_IDS), dict(HEALTH_CHECK_SAMPLING), rid="health-1",
                        disagg=health_check_disagg(started.pd))  # fmt: skip
    done: dict[str, dict] = {}
    for _ in range(2000):
        for eng in engines:
            eng.step()
        for rid in ("health-1", "r0", "r1", "r2"):
            if rid not in done and dec.result(rid, pop=False) is not None:
                done[rid] = dec.result(rid)
        if len(done) == 4 and all(e.core.scheduler.idle for e in engines):
            break
    else:
        raise AssertionError(f"not done: {sorted(done)}")
    health = done["health-1"]
    assert (
        health["meta_info"]["finish_reason"]["type"] in ("length", "stop") and len(health["output_ids"]) == 1
    )
    assert called.count("health-1") == 1  # through the one release path, once
    if started.pd:
        assert engines[0].result("health-1")["meta_info"]["finish_reason"]["type"] == "length"
        assert dec.core.view.connector_stats()["transfers_ok"] == len(prompts)  # the health check moved nothing
    want = make_engine(enable_prefix_cache=False).generate(input_ids=prompts, sampling_params=sp)
    for i, w in enumerate(want):
        if combos.exact(row):
            assert done[f"r{i}"]["output_ids"] == w["output_ids"], i
        assert len(done[f"r{i}"]["output_ids"]) == 12
    for eng in engines:
        assert_idle_clean(eng)


@pytest.mark.parametrize("row", SESSION_ROWS, ids=combos.row_id)
def test_aborted_session_turn_under_each_combination(start_combo, make_engine, row):
    """Seed 004's aborted turns under every configuration of the covering array that has session
    turns: a turn too long for the context is refused (400) before it holds anything, and one aborted
    between its prefill chunks never writes into the session; the session is as it was, and its next
    turn reads exactly its KV."""
    eng = start_combo(row, chunked_prefill_size=16).engines[0]
    ctx = eng.core.limits.context_length
    sid = eng.open_session()
    t1, t3 = list(range(3, 33)), [40, 41, 42]
    r1 = eng.generate(
        input_ids=t1, sampling_params={**GREEDY, "max_new_tokens": 6}, session_params={"id": sid}
    )
    before, mem = eng.sessions(), eng.memory()
    with pytest.raises(ValidationError) as e:
        eng.add_request([7] * (ctx - 36 + 1), {**GREEDY, "max_new_tokens": 1}, session_params={"id": sid})
    assert e.value.code == "context_length_exceeded"
    assert eng.sessions() == before and eng.memory() == mem
    rid = eng.add_request(list(range(100, 180)), {**GREEDY, "max_new_tokens": 8}, session_params={"id": sid})
    _step_until(eng, lambda: 0 < _live(eng, rid).kv_len < _live(eng, rid).seq_len - 1)
    eng.abort(rid)
    eng.step()
    assert eng.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    after = eng.sessions()
    assert [(s["tokens"], s["kv_tokens"], s["held_tokens"]) for s in after] == [
        (s["tokens"], s["kv_tokens"], s["held_tokens"]) for s in before
    ]
    r3 = eng.generate(
        input_ids=t3, sampling_params={**GREEDY, "max_new_tokens": 6}, session_params={"id": sid}
    )
    if combos.exact(row):
        ref = make_engine(enable_prefix_cache=False)
        assert [r1["output_ids"], r3["output_ids"]] == _reference_turns(ref, [t1, t3], [6, 6])
    eng.close_session(sid)
    assert_idle_clean(eng)
