"""The seams, driven through the real engine step with a fake executor: several tokens per request
per step (drafts accepted), rejected drafts given back with ``truncate``, stops inside an accepted
run, the over-allocation trim before a session takes its turn's KV, and page-table writes that
only ever name pages the request owns. Strict memory: conservation is checked every step."""

from __future__ import annotations

import pytest

from tests.fakes import FakeRunner, V, chain, use_fake_model
from tests.helpers import assert_idle_clean


class Proposer:
    """Drafts ``k`` tokens; the ones at indices in ``wrong`` are corrupted (rejected)."""

    def __init__(self, k: int, wrong: set[int] = frozenset()):
        self.k, self.wrong = k, wrong
        self.proposed = 0

    def propose(self, req) -> list[int]:
        drafts = chain(req.output_ids[-1] if req.output_ids else req.input_ids[-1], self.k)
        self.proposed += 1
        return [(d + 1) % V if j in self.wrong else d for j, d in enumerate(drafts)]


def _engine(make_engine, k: int, wrong=frozenset(), **kw):
    eng = make_engine(**kw)
    use_fake_model(eng.core)
    eng.core.scheduler.proposer = Proposer(k, set(wrong))
    return eng


def _books(eng) -> None:
    """After a step: every running request holds exactly the pages its KV needs plus its decode."""
    kvm = eng.core.kv_manager
    for req in eng.core.scheduler.running:
        if req.kv_len == req.seq_len - 1:
            assert len(req.pages) == max(-(-req.kv_len // kvm.page_size), req.num_tree_pages), req


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_all_drafts_accepted_gives_several_tokens_per_step(make_engine, page_size):
    eng = _engine(make_engine, k=4, page_size=page_size)
    prompt = [5, 9, 13]
    rid = eng.add_request(prompt, {"max_new_tokens": 23, "ignore_eos": True})
    sizes = []
    while eng.result(rid, pop=False) is None:
        for o in eng.step():
            if o.rid == rid and o.new_ids:
                sizes.append(len(o.new_ids))
        _books(eng)
    res = eng.result(rid)
    assert res["output_ids"] == chain(prompt[-1], 23)
    assert res["meta_info"]["finish_reason"]["type"] == "length"
    assert sizes[0] == 1 and set(sizes[1:-1]) == {5}  # 1 from the prefill, then 4 drafts + 1 bonus
    assert sum(sizes) == 23  # the last run was cut at max_new_tokens
    assert_idle_clean(eng)


@pytest.mark.parametrize("wrong", [{0}, {2}, {1, 3}])
def test_rejected_drafts_are_truncated_in_the_same_step(make_engine, wrong):
    eng = _engine(make_engine, k=4, wrong=wrong, page_size=4)
    prompt = [7] * 9
    rid = eng.add_request(prompt, {"max_new_tokens": 30, "ignore_eos": True})
    while eng.result(rid, pop=False) is None:
        eng.step()
        _books(eng)  # no page past the accepted KV survives the step
        eng.core.kv_manager.ledger.check_conservation()
    res = eng.result(rid)
    assert res["output_ids"] == chain(7, 30)  # exactly what plain decoding gives
    assert_idle_clean(eng)


def test_stop_token_inside_an_accepted_run_cuts_there(make_engine):
    eng = _engine(make_engine, k=6)
    expect = chain(11, 40)
    stop = expect[9]  # lands inside a run of accepted drafts
    out = eng.generate(input_ids=[11], sampling_params={"max_new_tokens": 40, "stop_token_ids": [stop]})
    assert out["output_ids"] == expect[: expect.index(stop) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_drafts_with_a_batch_of_plain_requests(make_engine):
    """Requests that get drafts and requests whose prefill chunks run in the same steps."""
    eng = _engine(make_engine, k=3, wrong={2}, page_size=4, chunked_prefill_size=16)
    prompts = [[3 + i] * (5 + 7 * i) for i in range(5)]
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 17, "ignore_eos": True})
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == chain(p[-1], 17)
    assert eng.core.scheduler.proposer.proposed > 0


@pytest.mark.parametrize("page_size", [4, 16])
def test_session_takes_only_the_accepted_kv(make_engine, page_size):
    """Seed 004's over-allocation trim: the turn's lookahead pages are freed before the session
    takes ownership of its KV."""
    eng = _engine(make_engine, k=5, wrong={3}, page_size=page_size)
    sid = eng.open_session()
    t1 = eng.generate(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 9, "ignore_eos": True},
                      session_params={"id": sid})  # fmt: skip
    s = eng.core.sessions.sessions[sid]
    assert t1["output_ids"] == chain(6, 9)
    assert s.kv_len == 3 + 9 - 1 and len(s.pages) == -(-s.kv_len // page_size)
    t2 = eng.generate(input_ids=[8], sampling_params={"max_new_tokens": 7, "ignore_eos": True},
                      session_params={"id": sid})  # fmt: skip
    assert t2["output_ids"] == chain(8, 7)
    assert len(s.pages) == -(-s.kv_len // page_size) and s.kv_len == len(s.tokens) - 1
    assert_idle_clean(eng)
    eng.close_session(sid)


def test_abort_and_retraction_mid_speculation_leak_nothing(make_engine):
    """A tiny pool: lookahead makes retraction happen; aborts land between verify steps."""
    eng = _engine(make_engine, k=6, wrong={4}, page_size=4, max_total_tokens=96, max_running_requests=8)
    rids = [eng.add_request([20 + i] * 9, {"max_new_tokens": 40, "ignore_eos": True}) for i in range(6)]
    for step in range(400):
        if step == 5:
            eng.abort(rids[1])
        eng.step()
        eng.core.kv_manager.ledger.check_conservation()
        if eng.core.scheduler.idle:
            break
    for i, rid in enumerate(rids):
        res = eng.result(rid)
        if i == 1:
            assert res["meta_info"]["finish_reason"]["type"] == "abort"
        else:
            assert res["output_ids"] == chain(20 + i, 40)
    assert eng.core.scheduler.total_retractions > 0
    assert_idle_clean(eng)


def test_several_tokens_without_drafts_are_computed_next_step(make_engine):
    """An executor may hand a request more tokens than it computed KV for (a jump forward): the
    scheduler computes the missing KV as a short prefill in the next step."""
    eng = make_engine(page_size=4)

    class Jumper(FakeRunner):
        def execute(self, sched, connector=None):
            out = super().execute(sched, connector)
            for i, r in enumerate(sched.reqs):
                if out.tokens[i]:
                    out.tokens[i] = chain(r.token_ids[-1], 3)
                    out.logprobs[i] = out.top_logprobs[i] = [None] * 3
            return out

    runner = use_fake_model(eng.core, Jumper(eng.core))
    out = eng.generate(input_ids=[9, 9], sampling_params={"max_new_tokens": 12, "ignore_eos": True})
    assert out["output_ids"] == chain(9, 12)
    assert runner.steps <= 6
