"""Grammars that would stall the engine (issue 50, item 1), on the offline engine and the tiny chat
model: a grammar compiles off the engine's thread (the engine steps other requests meanwhile), one
that takes longer than --grammar-compile-timeout-s is a 400 that held nothing, an abort reaches a
request whose grammar still compiles, and a grammar whose matching grows with the output is ended
before it slows every step. Books clean after each."""

from __future__ import annotations

import re
import threading

import pytest

from kvledger import Engine, ValidationError
from kvledger.common import RequestOutput
from kvledger.constrained import matcher
from kvledger.constrained.grammar import GrammarBackend, GrammarSpec
from tests.helpers import assert_idle_clean


@pytest.fixture(scope="module")
def chat_loaded(chat_model):
    from kvledger.model import load_model

    return load_model(chat_model)


def engine(chat_loaded, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    opts.update(kw)
    return Engine(loaded_model=chat_loaded, **opts)


@pytest.fixture
def slow_compiles(monkeypatch):
    """Every grammar compile waits for the returned event (set at teardown: no thread is left waiting)."""
    gate = threading.Event()
    real = GrammarBackend._new_state

    def slow(self, spec):
        gate.wait(60)
        return real(self, spec)

    monkeypatch.setattr(GrammarBackend, "_new_state", slow)
    yield gate
    gate.set()


def _run(eng: Engine, reqs: list, limit_s: float = 60.0) -> tuple[dict[str, RequestOutput], list[str]]:
    """Submit ``reqs`` as the engine process does (``make_request`` then ``submit``) and step until
    all have ended; their final outputs, and the order in which they ended."""
    import time

    core = eng.core
    for r in reqs:
        core.submit(r)
    finals: dict[str, RequestOutput] = {}
    order: list[str] = []
    end = time.monotonic() + limit_s
    while len(finals) < len(reqs):
        assert time.monotonic() < end, f"not done: {set(r.rid for r in reqs) - set(finals)}"
        for o in eng.step():
            if o.finished:
                finals[o.rid] = o
                order.append(o.rid)
    return finals, order


def test_a_grammar_compiles_off_the_engine_thread(chat_loaded):
    eng = engine(chat_loaded)
    core = eng.core
    req = core.make_request([5, 6], {"regex": "[ab]{4}", "max_new_tokens": 10})
    assert req.grammar is None and req.grammar_job is not None  # compiling on the backend's thread
    finals, _ = _run(eng, [req])
    assert finals[req.rid].finish_reason.type == "stop"
    assert re.fullmatch("[ab]{4}", core.tokenizer.decode(req.output_ids, skip_special_tokens=True))
    assert_idle_clean(eng)


def test_a_slow_compile_is_refused_while_others_run(chat_loaded, slow_compiles):
    eng = engine(chat_loaded, grammar_compile_timeout_s=0.5)
    core = eng.core
    before = eng.memory()
    slow = core.make_request([5, 6], {"regex": "[ab]{4}"}, rid="slow")
    plain = core.make_request([7, 8, 9], {"max_new_tokens": 6, "ignore_eos": True}, rid="plain")
    finals, order = _run(eng, [slow, plain])
    # The engine stepped the plain request to its end while the grammar compiled.
    assert order == ["plain", "slow"] and len(plain.output_ids) == 6
    fr = finals["slow"].finish_reason
    assert fr.status == 400 and fr.code == "grammar_compile_timeout" and fr.param == "regex", fr
    assert "--grammar-compile-timeout-s" in fr.message
    assert slow.slot is None and not slow.pages and slow.output_ids == []  # it never held anything
    assert_idle_clean(eng)
    assert eng.memory()["kv_free"] + eng.memory()["kv_cached_evictable"] == before["kv_free"]


def test_the_offline_api_raises_the_compile_timeout(chat_loaded, slow_compiles):
    eng = engine(chat_loaded, grammar_compile_timeout_s=0.3)
    before = eng.memory()
    with pytest.raises(ValidationError) as e:
        eng.generate(input_ids=[3, 4], sampling_params={"json_schema": '{"type": "object"}'})
    assert e.value.code == "grammar_compile_timeout" and e.value.param == "json_schema"
    assert eng.memory() == before
    assert_idle_clean(eng)


def test_an_abort_reaches_a_request_whose_grammar_compiles(chat_loaded, slow_compiles):
    eng = engine(chat_loaded)
    core = eng.core
    req = core.make_request([5, 6], {"regex": "[ab]{4}"}, rid="g")
    core.submit(req)
    eng.step()
    assert core.scheduler.compiling == [req]
    core.abort("g")
    outs = eng.step()
    assert [o.finish_reason.type for o in outs if o.rid == "g"] == ["abort"]
    assert core.scheduler.compiling == [] and req.grammar_job is None
    assert_idle_clean(eng)


def test_a_grammar_too_costly_to_follow_ends_its_request_alone(chat_loaded, monkeypatch):
    """Under a per-token limit of 0 every matcher call is over it: the constrained request ends with
    a 400 after MASK_STRIKES calls, its unconstrained neighbour is unchanged."""
    eng = engine(chat_loaded)
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = eng.generate(input_ids=[7, 8, 9], sampling_params=sp)["output_ids"]
    monkeypatch.setattr(matcher, "MASK_CPU_LIMIT_S", 0.0)
    core = eng.core
    g = core.make_request([5, 6], {"regex": "[ab]{20}", "max_new_tokens": 30}, rid="g")
    n = core.make_request([7, 8, 9], sp, rid="n")
    finals, _ = _run(eng, [g, n])
    fr = finals["g"].finish_reason
    assert fr.type == "abort" and fr.status == 400 and fr.code == "grammar_too_slow" and fr.param == "regex", fr
    assert len(g.output_ids) < 5
    assert n.output_ids == want
    assert_idle_clean(eng)


def test_an_ambiguous_regex_is_caught_by_the_matching_limit(chat_loaded):
    """xgrammar's work for (x+x+)+y grows with every x: the per-token limit catches it within a few
    hundred tokens, where an unambiguous x+ never strikes."""
    tok = chat_loaded.tokenizer
    backend = GrammarBackend(tok, 260, [tok.eos_token_id])
    x = tok.convert_tokens_to_ids("x")
    for pattern, slow in (("x+", False), ("(x+x+)+y", True)):
        state = backend.new_state(GrammarSpec("regex", pattern))
        for _ in range(600):
            state.masks([])
            assert state.accept([x])
            if state.too_slow:
                break
        assert state.too_slow == slow, (pattern, state.slowest_s)
    backend.shutdown()
