"""Overlap scheduling (issue 32, ``scheduler/overlap.py``): the same outputs with overlap on and off
across the engine's scenarios (chunked and mixed prefill, stops of every kind, max_new_tokens=1,
penalties, seeded draws, logprobs, retraction, speculation, grammars, sessions, aborts at every
step, a fault), books clean (every engine is audited idle); a request that ends while a later step
holding it is in flight has that row dropped and its pages released only after it."""

from __future__ import annotations

import json

import pytest

from kvledger import Engine
from tests.helpers import assert_idle_clean

ON, OFF = False, True  # disable_overlap_schedule


@pytest.fixture(scope="module")
def chat_loaded(chat_model):
    from kvledger.model import load_model

    return load_model(chat_model)


def engine(loaded, overlap_off: bool, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    opts.update(kw)
    eng = Engine(loaded_model=loaded, disable_overlap_schedule=overlap_off, **opts)
    assert eng.core.overlap is (not overlap_off)
    return eng


def seen(results: list[dict]) -> list[tuple]:
    """What a client sees of each result: tokens, text, finish reason, counts, and the logprobs to 4
    places (a batch of another shape may move float32's last bits)."""
    out = []
    for r in results:
        m = r["meta_info"]
        lps = [_rounded(m.get(k)) for k in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs")]
        out.append((r["output_ids"], r["text"], m["finish_reason"], m["completion_tokens"], *lps))
    return out


def _rounded(v):
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def both(loaded, jobs, **kw) -> tuple[list[tuple], Engine, Engine]:
    """``jobs`` (prompt ids, sampling) on an engine with overlap and one without; the overlapped one
    must have overlapped steps."""
    res = []
    engs = []
    for off in (ON, OFF):
        eng = engine(loaded, off, **kw)
        res.append(seen(eng.generate(input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs])))
        assert_idle_clean(eng)
        engs.append(eng)
    assert res[0] == res[1]
    assert engs[0].core.overlap_stats["overlapped"] > 0
    return res[0], engs[0], engs[1]


def mixed_jobs() -> list[tuple[list[int], dict]]:
    g = {"temperature": 0}
    jobs = [
        ([5] * 70, {**g, "max_new_tokens": 1}),  # chunked prompt, one token
        ([6, 7, 8], {**g, "max_new_tokens": 1, "ignore_eos": True}),
        ([9] * 12, {**g, "max_new_tokens": 2, "ignore_eos": True}),
        (list(range(20, 60)), {**g, "max_new_tokens": 24}),  # EOS may end it
        (list(range(60, 75)), {**g, "max_new_tokens": 30, "stop": ["^", "zz"]}),  # stop strings
        (list(range(75, 90)), {**g, "max_new_tokens": 30, "stop_token_ids": [162]}),
        ([11] * 40, {"temperature": 1.0, "seed": 3, "max_new_tokens": 20, "ignore_eos": True}),
        ([12] * 33, {"temperature": 0.9, "top_p": 0.8, "seed": 4, "max_new_tokens": 18, "frequency_penalty": 0.7,
                     "presence_penalty": 0.3, "repetition_penalty": 1.2}),
        ([13] * 25, {**g, "max_new_tokens": 16, "min_new_tokens": 10, "logprobs": True, "top_logprobs": 2}),
        ([14] * 21, {**g, "max_new_tokens": 8, "logprobs": True, "logprob_start_len": 3}),  # prompt logprobs
    ]
    jobs += [([30 + i] * (5 + 17 * i), {**g, "max_new_tokens": 4 + 3 * i, "ignore_eos": True}) for i in range(6)]
    return jobs


@pytest.mark.parametrize("mixed", [False, True])
def test_same_outputs_chunked_mixed_and_every_stop(chat_loaded, mixed):
    out, on, _ = both(chat_loaded, mixed_jobs(), chunked_prefill_size=32, enable_mixed_chunk=mixed)
    assert len(out[0][0]) == 1 and len(out[1][0]) == 1 and len(out[2][0]) == 2
    assert any(o[2]["type"] == "stop" and isinstance(o[2].get("matched"), str) for o in out)  # a stop string hit
    # The prompt-logprob request makes the step after its chunk wait for it; the rest overlap.
    assert on.core.overlap_stats["synchronous"] > 0


def test_same_outputs_under_retraction_and_at_the_context_end(chat_loaded):
    jobs = [([40 + i] * (20 + 11 * i), {"temperature": 0, "ignore_eos": True, "max_new_tokens": 40}) for i in range(8)]
    jobs.append(([7] * 180, {"temperature": 0, "ignore_eos": True}))  # to the context end
    out, on, off = both(chat_loaded, jobs, max_total_tokens=320, chunked_prefill_size=16, context_length=200,
                        max_running_requests=6)  # fmt: skip
    assert on.core.scheduler.total_retractions > 0 and off.core.scheduler.total_retractions > 0
    assert out[-1][2]["type"] == "length" and out[-1][3] == 20  # its last token at the context end


def test_speculation_waits_for_each_step(chat_loaded):
    """With a proposer a step that samples waits for the one before (drafts come from the output);
    prompt chunks short of the end still overlap."""
    jobs = [([3, 4, 5, 6] * (6 + 3 * i), {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}) for i in range(5)]
    # Prefill first: an interleaved decode step between two chunks would wait for its drafts too.
    _, on, _ = both(chat_loaded, jobs, speculative_algorithm="ngram", chunked_prefill_size=16,
                    interleave_prefill_tokens=0)  # fmt: skip
    st = on.core.overlap_stats
    assert st["synchronous"] > st["overlapped"] > 0, st
    assert on.core.scheduler.spec_totals.drafted > 0


def test_grammars_with_plain_neighbours(chat_loaded):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}  # fmt: skip
    jobs = [
        ([5] * 14, {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)}),
        ([6] * 9, {"temperature": 1.0, "seed": 2, "max_new_tokens": 40, "regex": r"[ab]{5}"}),
    ]
    jobs += [([70 + i] * (9 + 5 * i), {"temperature": 0, "ignore_eos": True, "max_new_tokens": 30}) for i in range(3)]
    out, on, _ = both(chat_loaded, jobs[2:], chunked_prefill_size=16)  # alone: overlapped
    out, on, _ = both(chat_loaded, jobs, chunked_prefill_size=16)
    assert json.loads(out[0][1])["n"] in range(100) and len(out[1][1]) == 5
    assert on.core.overlap_stats["synchronous"] > 0  # a grammar row's step waits for its result


def test_session_turns(chat_loaded):
    turns = [[5, 6, 7, 8], [9, 10], list(range(30, 70)), [11]]
    results = []
    for off in (ON, OFF):
        eng = engine(chat_loaded, off, chunked_prefill_size=16)
        sid = eng.open_session()
        got = []
        for i, t in enumerate(turns):
            sp = {"temperature": 0, "max_new_tokens": 1 if i == 3 else 9, "ignore_eos": i != 1}
            got.append(seen([eng.generate(input_ids=t, sampling_params=sp, session_params={"id": sid})]))
        got.append(eng.sessions()[0]["held_tokens"])
        eng.close_session(sid)
        assert_idle_clean(eng)
        results.append(got)
    assert results[0] == results[1]


def test_abort_at_every_step(chat_loaded):
    """An abort after each number of steps: the other requests are unchanged, the aborted one's output
    is a prefix of its full output, nothing leaks (audited idle after each)."""
    jobs = [([20 + i] * (10 + 13 * i), {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}) for i in range(4)]
    ref = seen(engine(chat_loaded, OFF, chunked_prefill_size=16).generate(
        input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs]))  # fmt: skip
    eng = engine(chat_loaded, ON, chunked_prefill_size=16)
    for k in range(16):
        for victim in (1, 3):
            rids = [eng.add_request(p, sp, rid=f"{k}-{victim}-{i}") for i, (p, sp) in enumerate(jobs)]
            for _ in range(k):
                eng.step()
            eng.abort(rids[victim])
            finals = {}
            while not eng.core.scheduler.idle:
                finals.update((o.rid, o) for o in eng.step() if o.finished)
            for i, rid in enumerate(rids):
                res = eng.result(rid)
                if i == victim:
                    # a prefix, and the engine's own count says the same (no token it never received)
                    assert res["output_ids"] == ref[i][0][: len(res["output_ids"])]
                    if rid in finals:
                        assert finals[rid].completion_tokens == len(res["output_ids"]), (k, victim)
                else:
                    assert seen([res]) == [ref[i]], (k, victim, i)
            assert_idle_clean(eng)


def test_fault_is_contained_with_overlap(chat_loaded, monkeypatch):
    jobs = [([3 + i] * (10 + 9 * i), {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}) for i in range(5)]
    ref = seen(engine(chat_loaded, OFF).generate(input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs]))
    monkeypatch.setenv("KVLEDGER_TEST_FAULT_RIDS", "bad")
    eng = engine(chat_loaded, ON)
    rids = [eng.add_request(p, sp, rid="bad" if i == 2 else None) for i, (p, sp) in enumerate(jobs)]
    eng.run_until_idle()
    for i, rid in enumerate(rids):
        res = eng.result(rid)
        if rid == "bad":
            fr = res["meta_info"]["finish_reason"]
            assert fr["type"] == "abort" and "injected fault" in fr["message"] and res["output_ids"] == []
        else:
            assert seen([res]) == [ref[i]]
    assert_idle_clean(eng)


def test_an_ended_request_keeps_its_pages_until_the_step_holding_it_is_in(chat_loaded):
    """EOS, a stop or the last token arrives in step N's result while step N+1 (launched from a
    placeholder) holds the request: the final output comes at once with exactly its tokens, N+1's row
    is dropped, and its pages go back through the release path only after N+1's result."""
    g = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}
    toks = engine(chat_loaded, OFF).generate(input_ids=list(range(20, 60)), sampling_params=g)["output_ids"]
    stop = next(t for j, t in enumerate(toks) if j >= 2 and t not in toks[:j])  # unforeseeable: a stop id
    want = toks[: toks.index(stop) + 1]
    eng = engine(chat_loaded, ON)
    core, s = eng.core, eng.core.scheduler
    eng.add_request(list(range(20, 60)), {**g, "stop_token_ids": [stop]}, rid="short")
    eng.add_request([6] * 20, {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}, rid="long")
    # Its last token foreseen (max_new_tokens): no row is launched past it, so it is released at once.
    eng.add_request([7] * 20, {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4}, rid="four")
    finals = {}
    held_after_final = None
    for _ in range(20):
        outs = eng.step()
        for o in outs:
            if o.finished:
                finals[o.rid] = o
                if o.rid == "four":
                    assert "four" not in s.reqs and not any(r.rid == "four" for r in s.releasing)
        if "short" in finals and held_after_final is None:
            req = next((r for r in s.releasing if r.rid == "short"), None)
            # Ended in step N's result, N+1 in flight with its row: pages still held, not running.
            assert req is not None and req.pages and req not in s.running, "released while in flight"
            assert "short" not in s.reqs  # ended for its client: an abort of it is refused
            assert req.output_ids == eng.result("short", pop=False)["output_ids"]
            held_after_final = len(req.pages)
        elif held_after_final is not None and not s.releasing:
            break
    assert held_after_final and "short" not in s.reqs
    assert finals["short"].completion_tokens == len(want) and eng.result("short")["output_ids"] == want
    assert core.overlap_stats["overlapped"] > 0
    eng.run_until_idle()
    assert len(eng.result("long")["output_ids"]) == 10


class _Histories:
    """Wraps an engine's executor: every penalty row's history as the runner receives it."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def execute_model(self, sched):
        for sr in sched.reqs:
            if sr.sampling is not None and sr.sampling.output_ids is not None:
                self.seen.append((sr.rid, sr.sampling.position, list(sr.sampling.output_ids)))
        return self.inner.execute_model(sched)


def test_penalty_rows_see_exactly_the_tokens_before_them(chat_loaded):
    """A penalty row's history is a copy taken at schedule time, its placeholder resolved by the
    executor: the runner sees the same history as in a synchronous step (never a later placeholder)."""
    jobs = [([12 + i] * (20 + 7 * i), {"temperature": 0.8, "seed": i, "max_new_tokens": 12, "ignore_eos": True,
                                        "frequency_penalty": 1.5, "repetition_penalty": 1.3}) for i in range(3)]  # fmt: skip
    seen_by = []
    for off in (ON, OFF):
        eng = engine(chat_loaded, off)
        rec = eng.core.executor = _Histories(eng.core.executor)
        eng.generate(input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs], rid=["a", "b", "c"])
        assert all(len(h) == pos and min(h, default=0) >= 0 for _, pos, h in rec.seen)
        seen_by.append(sorted(rec.seen))
        assert_idle_clean(eng)
    assert seen_by[0] == seen_by[1]


def test_an_overlapped_row_given_several_tokens_goes_on_from_its_kv(make_engine):
    """The executor seam allows 0..k tokens a row (a jump forward): a row that was planned on one
    token (its next step launched from a placeholder) drops the later placeholder's row and goes on
    from the KV it computed; the output is the synchronous one."""
    from tests.fakes import FakeRunner, chain, use_fake_model

    class Jumper(FakeRunner):
        def execute(self, sched, connector=None):
            out = super().execute(sched, connector)
            for i, r in enumerate(sched.reqs):
                if out.tokens[i]:
                    out.tokens[i] = chain(r.token_ids[-1], 3)
                    out.logprobs[i] = out.top_logprobs[i] = [None] * 3
            return out

    eng = make_engine(page_size=4, disable_overlap_schedule=False)
    use_fake_model(eng.core, Jumper(eng.core))
    out = eng.generate(input_ids=[[9, 9], [4] * 11], sampling_params={"max_new_tokens": 12, "ignore_eos": True})
    assert [o["output_ids"] for o in out] == [chain(9, 12), chain(4, 12)]
    assert eng.core.overlap_stats["overlapped"] > 0
