"""Structured outputs on the offline engine (tiny chat model with a real byte-level tokenizer): the
grammar holds under batching with unconstrained neighbours, chunked prefill, retraction and
speculative drafts; bad grammars are refused before anything is held; books clean."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from kvledger import Engine, ValidationError
from tests.helpers import assert_idle_clean

# Finite languages: a random model must still produce a complete, valid output.
SCHEMAS = [
    {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"]},
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
    },
    {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3}},
        "required": ["xs"],
    },
    {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"v": {"type": "null"}}, "required": ["v"]},
            "s": {"type": "string", "pattern": "^[a-z]{1,4}$"},
        },
        "required": ["inner", "s"],
    },
]
REGEXES = [r"[ab]{5}", r"(yes|no)", r"[0-9]{3}-[0-9]{2}", r"x(y|z){2,4}"]


@pytest.fixture(scope="module")
def chat_loaded(chat_model):
    from kvledger.model import load_model

    return load_model(chat_model)


def engine(chat_loaded, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=16, max_total_tokens=4096, strict_memory=True)
    opts.update(kw)
    return Engine(loaded_model=chat_loaded, **opts)


def _jobs(temperature: float) -> list[tuple[list[int], dict, tuple[str, object] | None]]:
    jobs = []
    for i, s in enumerate(SCHEMAS):
        jobs.append(([5 + i] * (10 + 9 * i), {"json_schema": json.dumps(s)}, ("schema", s)))
    for i, r in enumerate(REGEXES):
        jobs.append(([40 + i] * (7 + 13 * i), {"regex": r}, ("regex", r)))
    for i in range(6):  # unconstrained neighbours in the same batches
        jobs.append(([90 + i] * (30 + 5 * i), {"ignore_eos": True}, None))
    return [
        (ids, {"max_new_tokens": 48, "temperature": temperature, "seed": 7, **sp}, chk)
        for ids, sp, chk in jobs
    ]


def _check(text: str, chk) -> None:
    kind, v = chk
    if kind == "schema":
        jsonschema.validate(json.loads(text), v)
    else:
        assert re.fullmatch(v, text), (v, text)


def _run(eng: Engine, jobs) -> list[dict]:
    return eng.generate(input_ids=[j[0] for j in jobs], sampling_params=[j[1] for j in jobs])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_hold_with_neighbours_chunks_and_retraction(chat_loaded, temperature):
    jobs = _jobs(temperature)
    ref = engine(chat_loaded)
    refs = _run(ref, jobs)
    for out, (_, _, chk) in zip(refs, jobs):
        if chk is not None:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            _check(out["text"], chk)
    # A pool small enough to retract, chunks smaller than the prompts: the same outputs (seeded).
    small = engine(chat_loaded, max_total_tokens=320, chunked_prefill_size=16, max_running_requests=6)
    outs = _run(small, jobs)
    assert small.core.scheduler.total_retractions > 0
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in refs]
    assert_idle_clean(ref)
    assert_idle_clean(small)


def test_speculative_drafts_keep_the_grammar_and_the_greedy_output(chat_loaded):
    jobs = _jobs(0.0)
    plain = engine(chat_loaded)
    spec = engine(chat_loaded, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    refs, outs = _run(plain, jobs), _run(spec, jobs)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in refs]
    assert spec.core.scheduler.spec_totals.drafted > 0
    for out, (_, _, chk) in zip(outs, jobs):
        if chk is not None:
            _check(out["text"], chk)
    assert_idle_clean(plain)
    assert_idle_clean(spec)


def test_masks_for_drafts_follow_the_grammar_and_roll_back(chat_loaded):
    eng = engine(chat_loaded)
    tok = chat_loaded.tokenizer
    req = eng.core.make_request([5, 6], {"regex": "ab(c|d)"})
    eng.core.wait_grammar(req)  # (compiled off the engine's thread)
    state = req.grammar
    a, b, c, z = (tok.convert_tokens_to_ids(x) for x in "abcz")

    def allowed(row: np.ndarray) -> set[int]:
        return {t for t in range(260) if row[t // 32] >> (t % 32) & 1}

    m = state.masks([a, b, z, c])  # z breaks the grammar: rows after it repeat row 2
    assert (
        allowed(m[0]) == {a} and allowed(m[1]) == {b} and allowed(m[2]) == {c, tok.convert_tokens_to_ids("d")}
    )
    assert (m[3] == m[2]).all() and (m[4] == m[2]).all()
    assert allowed(state.masks([])[0]) == {a}  # rolled back: still at the start
    # No draft is verified past the end: not the stop token that ends the grammar, nor after it.
    eos = tok.eos_token_id
    assert state.drafts_before_end([a, b, c, eos, eos]) == 3 and state.drafts_before_end([a, b, c]) == 3
    assert state.drafts_before_end([a, z, c]) == 3  # a refused draft stays (its rows repeat)
    assert allowed(state.masks([])[0]) == {a}  # rolled back again
    assert state.accept([a, b]) and not state.terminated
    eng.shutdown()


def test_grammar_end_under_ignore_eos_ends_the_request(chat_loaded):
    eng = engine(chat_loaded)
    out = eng.generate(
        input_ids=[7, 8], sampling_params={"regex": "[ab]{3}", "ignore_eos": True, "max_new_tokens": 20}
    )
    assert re.fullmatch("[ab]{3}", out["text"])
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "stop" and len(out["output_ids"]) == 4  # three letters and the stop token
    # A grammar with no finite string ends at max_new_tokens.
    out = eng.generate(input_ids=[7, 8], sampling_params={"ebnf": 'root ::= "a" root', "max_new_tokens": 9})
    assert out["text"] == "a" * 9 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert_idle_clean(eng)


class _ScriptedDrafts:
    """Drafts read from a script: the rest of the expected output, then more of its last (stop)
    token. ``writes_kv`` takes the draft-model path (lookahead pages allocated before ``propose``)."""

    def __init__(self, script: list[int], writes_kv: bool, k: int = 4):
        self.script, self.writes_kv, self.k = script, writes_kv, k

    def _next(self, req, k: int) -> list[int]:
        return (self.script[len(req.output_ids) :] + [self.script[-1]] * k)[:k]

    def num_drafts(self, req, limit: int) -> int:
        return min(self.k, limit)

    def propose(self, req, k: int | None = None) -> list[int]:
        return self._next(req, self.k if k is None else k)


@pytest.mark.parametrize("writes_kv", [False, True])
def test_drafts_past_the_grammar_end_are_not_kept(chat_loaded, writes_kv):
    """Under ignore_eos only the grammar ends a request, at its stop token. Drafts that run past it
    (the stop token twice, as a draft model proposed in the combination fuzz: tp+draft+hicache, seed
    1779861933) must not put a token after the end: the output is the plain engine's, and the
    request stops instead of aborting with 'a token broke the grammar'."""
    sp = {"regex": "[ab]{3}", "ignore_eos": True, "max_new_tokens": 20, "temperature": 0}
    plain = engine(chat_loaded)
    want = plain.generate(input_ids=[7, 8], sampling_params=sp)["output_ids"]
    assert len(want) == 4  # three letters and the stop token
    eng = engine(chat_loaded, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    eng.core.scheduler.proposer = _ScriptedDrafts(want, writes_kv)
    out = eng.generate(input_ids=[7, 8], sampling_params=sp)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]["finish_reason"]
    assert out["output_ids"] == want
    assert eng.core.scheduler.spec_totals.accepted > 0  # the scripted drafts were verified and kept
    assert_idle_clean(plain)
    assert_idle_clean(eng)


@pytest.mark.parametrize(
    "sp, param",
    [
        ({"regex": "((("}, "regex"),
        ({"ebnf": "root ::= "}, "ebnf"),
        ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": 5}, "json_schema"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
        ({"regex": ""}, "regex"),
    ],
)
def test_bad_grammars_are_400_and_hold_nothing(chat_loaded, sp, param):
    eng = engine(chat_loaded)
    before = eng.memory()
    with pytest.raises(ValidationError) as e:
        eng.generate(input_ids=[3, 4], sampling_params=sp)
    assert e.value.param == param and e.value.status == 400, e.value.message
    assert eng.memory() == before
    assert_idle_clean(eng)


def test_a_model_without_tokenizer_refuses_grammars(make_engine):
    eng = make_engine()
    with pytest.raises(ValidationError, match="tokenizer"):
        eng.generate(input_ids=[3, 4], sampling_params={"regex": "a"})


def test_min_new_tokens_masks_the_stop_tokens(chat_loaded):
    eng = engine(chat_loaded)
    free = eng.generate(
        input_ids=[9, 10, 11], sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    )
    first = free["output_ids"][0]
    sp = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first]}
    assert eng.generate(input_ids=[9, 10, 11], sampling_params=sp)["output_ids"] == [first]
    held = eng.generate(input_ids=[9, 10, 11], sampling_params={**sp, "min_new_tokens": 5})["output_ids"]
    assert len(held) >= 5 and first not in held[:5]
    # With a grammar too: both masks hold.
    out = eng.generate(
        input_ids=[9, 10, 11],
        sampling_params={"regex": "[ab]{2,6}", "min_new_tokens": 4, "max_new_tokens": 10},
    )
    assert re.fullmatch("[ab]{4,6}", out["text"]), out["text"]
    assert_idle_clean(eng)


def test_min_new_tokens_with_nothing_to_hold_back_builds_no_mask(chat_loaded, monkeypatch):
    """ignore_eos and no stop_token_ids: min_new_tokens has no token to mask, so no bitmask goes to
    the sampler (an all-ones mask for every row of every step was what slowed benchmark clients that
    send min_tokens with ignore_eos, as kvledger bench does); with the EOS to hold back, masks go."""
    from kvledger.scheduler import rows as batch_rows

    seen: list[bool] = []
    real = batch_rows.min_tokens_mask

    def spy(req, rows, mask, stop, vocab_size):
        out = real(req, rows, mask, stop, vocab_size)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(batch_rows, "min_tokens_mask", spy)
    eng = engine(chat_loaded)
    sp = {"max_new_tokens": 6, "temperature": 0, "min_new_tokens": 6}
    eng.generate(input_ids=[9, 10, 11], sampling_params={**sp, "ignore_eos": True})
    assert seen and not any(seen)
    seen.clear()
    eng.generate(input_ids=[9, 10, 11], sampling_params=sp)
    assert any(seen)  # the EOS held back
    assert_idle_clean(eng)


def test_stop_regex_ends_and_cuts_the_text(chat_loaded):
    eng = engine(chat_loaded)
    out = eng.generate(
        input_ids=[9, 10, 11],
        sampling_params={"regex": "abc[0-9]+xyz", "stop_regex": "[0-9]{2}", "max_new_tokens": 20},
    )
    fr = out["meta_info"]["finish_reason"]
    assert fr == {"type": "stop", "matched": "[0-9]{2}"} and out["text"] == "abc", (fr, out["text"])
    for bad in ("(((", ["a", 5], [""]):
        with pytest.raises(ValidationError) as e:
            eng.generate(input_ids=[3], sampling_params={"stop_regex": bad})
        assert e.value.param == "stop_regex"
    with pytest.raises(ValidationError):
        eng.generate(input_ids=[3], sampling_params={"min_new_tokens": -1})
    assert_idle_clean(eng)


def test_stop_regex_reports_its_pattern_and_cuts_where_it_matched(chat_loaded):
    """SGLang's matched_stop for a stop_regex is the pattern (which stop ended it, as for stop strings);
    the text is cut where the match that ended the request starts, not at an earlier "or"."""
    eng = engine(chat_loaded)
    out = eng.generate(
        input_ids=[9, 10, 11],
        sampling_params={"regex": "for or not", "stop_regex": ["zz", r"\bor\b"], "max_new_tokens": 20},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\bor\b"}
    assert out["text"] == "for "
    assert_idle_clean(eng)
