"""The bug reports in shared/seeds/ as named tests, plus the production-mode leak path."""

from __future__ import annotations

import pytest

from kvledger import ValidationError
from kvledger.errors import NotFoundError
from tests.helpers import assert_idle_clean

GREEDY = {"temperature": 0, "ignore_eos": True}


def _step_until(eng, cond, limit=500):
    eng.step()  # take submitted requests in
    for _ in range(limit):
        if cond():
            return
        eng.step()
    raise AssertionError("condition never reached")


def _live(eng, rid):
    return eng.core.scheduler.reqs.get(rid)


def test_finish_in_first_mixed_prefill_chunk(make_engine):
    """Seed 000: max_new_tokens=1 with mixed chunks finishes in the forward of its only prefill chunk."""
    eng = make_engine(enable_mixed_chunk=True, chunked_prefill_size=64)
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
    assert all(len(eng.result(r)["output_ids"]) == 30 for r in runners)


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


def test_production_mode_leak_is_reported_reclaimed_and_serving_goes_on(tiny_loaded):
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
    assert lc["violations"] == 1 and not lc["ok"]
    assert eng.core.kv_manager.ledger.reclaimed_pages == 1 and pool.is_free(dropped[0])
    out = eng.generate(input_ids=list(range(3, 30)), sampling_params={**GREEDY, "max_new_tokens": 5})
    assert len(out["output_ids"]) == 5
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
