"""A grammar after the reasoning (``--reasoning-parser``, a request's ``require_reasoning``): the
scripted reasoning model writes ``<think>Why</think>`` and the grammar holds only from there; drafts
that cross ``</think>`` are masked by the grammar after it (NGRAM, output equal to the plain engine's);
a marker of several tokens is matched across steps; ``require_reasoning`` without a parser is a 400
that holds nothing. Books clean after each engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvledger import Engine, ValidationError
from kvledger.constrained.reasoning import ReasoningGate
from tests.helpers import assert_idle_clean

SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})


@pytest.fixture(scope="module")
def loaded(reasoning_model):
    from kvledger.model import load_model

    return load_model(reasoning_model)


@pytest.fixture
def engines(loaded):
    made = []

    def make(**kw) -> Engine:
        opts = dict(dtype="float32", page_size=16, max_total_tokens=2048, strict_memory=True)
        eng = Engine(loaded_model=loaded, **{**opts, **kw})
        made.append(eng)
        return eng

    yield make
    for eng in made:
        assert_idle_clean(eng)


def prompt(eng: Engine, user: str = "hi") -> list[int]:
    return eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, return_dict=False
    )


@pytest.mark.parametrize("sp", [{"json_schema": SCHEMA}, {"regex": r"\{\"ok\": (true|false)\}"}])
def test_the_grammar_starts_after_the_reasoning(engines, sp):
    eng = engines(reasoning_parser="qwen3")
    base = {"max_new_tokens": 40, "temperature": 0, **sp}
    free = eng.generate(input_ids=prompt(eng), sampling_params={**base, "require_reasoning": True})
    assert free["text"] == '<think>Why</think>{"ok": false}', free
    assert free["meta_info"]["finish_reason"]["type"] == "stop"
    # Without require_reasoning the grammar holds from the first token: no reasoning at all.
    bound = eng.generate(input_ids=prompt(eng), sampling_params=base)
    assert bound["text"] == '{"ok": false}', bound


def test_drafts_across_the_end_marker_keep_the_output(engines):
    """NGRAM drafts from the prompt, which holds the whole answer: one step's drafts run from the
    reasoning through ``</think>`` into the JSON, so its rows mix unmasked and grammar rows."""
    plain = engines(reasoning_parser="deepseek-r1")
    spec = engines(reasoning_parser="deepseek-r1", speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    user = '<think>Why</think>{"ok": false}'
    sp = {"max_new_tokens": 40, "temperature": 0, "json_schema": SCHEMA, "require_reasoning": True}
    ref = plain.generate(input_ids=prompt(plain, user), sampling_params=sp)
    out = spec.generate(input_ids=prompt(spec, user), sampling_params=sp)
    assert out["output_ids"] == ref["output_ids"] and out["text"] == '<think>Why</think>{"ok": false}'
    t = spec.core.scheduler.spec_totals
    assert t.accepted >= 8, (t.drafted, t.accepted)  # drafts were verified past the marker


def test_require_reasoning_needs_a_reasoning_parser(engines):
    eng = engines()
    with pytest.raises(ValidationError) as e:
        eng.generate(input_ids=prompt(eng), sampling_params={"json_schema": SCHEMA, "require_reasoning": True})
    assert e.value.param == "require_reasoning" and e.value.status == 400
    with pytest.raises(ValidationError) as e:
        eng.generate(input_ids=prompt(eng), sampling_params={"require_reasoning": "yes"})
    assert e.value.param == "require_reasoning"
    assert eng.memory()["kv_private"] == 0


class FakeGrammar:
    """A stand-in matcher: records what it accepts; its masks say how many drafts they cover."""

    width = 2

    def __init__(self):
        self.accepted: list[int] = []
        self.terminated = False

    def masks(self, drafts):
        return np.full((len(drafts) + 1, self.width), 7, dtype=np.int32)

    def drafts_before_end(self, drafts):
        return len(drafts) - 1 if drafts else 0  # the last draft "ends" it

    def accept(self, tokens):
        self.accepted += tokens
        return True


def test_a_marker_of_several_tokens_is_matched_across_steps():
    inner = FakeGrammar()
    gate = ReasoningGate(inner, [5, 6, 7])  # e.g. "</", "think", ">" in a tokenizer without the marker
    assert gate.masks([1, 2]) is None and gate.drafts_before_end([1, 2]) == 2
    assert gate.accept([1, 5]) and gate.accept([6]) and gate.thinking  # a partial match: still thinking
    m = gate.masks([7, 9])  # the marker ends at draft 0: the rows after it are the grammar's
    assert (m[0] == -1).all() and (m[1:] == 7).all()
    assert gate.drafts_before_end([7, 9, 9]) == 1 + 1
    assert gate.accept([7, 8]) and not gate.thinking and inner.accepted == [8]
    assert gate.masks([3]).tolist() == inner.masks([3]).tolist()
    gate2 = ReasoningGate(FakeGrammar(), [5, 6, 7])
    assert gate2.accept([5, 6, 5, 6, 4]) and gate2.thinking and gate2.inner.accepted == []  # no false match


def test_a_parser_needs_a_known_name_and_the_models_tokenizer(make_engine):
    with pytest.raises(ValidationError, match="deepseek-r1, qwen3") as e:
        make_engine(reasoning_parser="deepseek")
    assert e.value.param == "reasoning_parser"
    with pytest.raises(ValidationError, match="tokenizer") as e:  # the tiny Llama has none: </think> unknown
        make_engine(reasoning_parser="qwen3")
    assert e.value.param == "reasoning_parser"
