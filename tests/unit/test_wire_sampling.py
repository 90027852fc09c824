"""SamplingParams is one type from the validation to the sampler: it crosses the front -> engine wire
as itself (msgspec, every field), and scoring is a field the validation sets, not max_new_tokens 0."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvledger import ValidationError
from kvledger.common import Limits, SamplingParams, check_typed_request, validate_request
from kvledger.common import messages as m

LIMITS = Limits(vocab_size=256, context_length=100)

# Every field away from its default (not one valid request: the codec checks types, the validation ranges).
EVERY_FIELD = SamplingParams(
    max_new_tokens=0, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, stop=["\n", "END"],
    stop_regex=["a+b"], min_new_tokens=2, stop_token_ids=[7, 9], ignore_eos=True, seed=2**63 - 1,
    repetition_penalty=1.1, frequency_penalty=-0.5, presence_penalty=0.25, logprobs=True, top_logprobs=3,
    skip_special_tokens=False, no_stop_trim=True, logprob_start_len=0, json_schema='{"type": "object"}',
    regex="[a-z]+", ebnf='root ::= "a"', cache_salt="3:abcsalt", lora_path="adapter-1", timeout=2.5,
    priority=-(2**63), require_reasoning=True, scoring=True,
)  # fmt: skip


def test_every_field_of_the_sample_is_away_from_its_default():
    # A field added to SamplingParams and not to EVERY_FIELD fails here, so the round trip covers it.
    default = SamplingParams()
    same = [f for f in SamplingParams.__struct_fields__ if getattr(EVERY_FIELD, f) == getattr(default, f)]
    assert same == []


def test_sampling_params_round_trip_through_the_wire_unchanged():
    frame = m.encode(m.AddRequest("r1", [1, 2, 3], EVERY_FIELD))
    msg = m.decode_to_engine(frame)
    assert isinstance(msg, m.AddRequest) and isinstance(msg.sampling, SamplingParams)
    assert msg.sampling == EVERY_FIELD
    for f in SamplingParams.__struct_fields__:
        got, want = getattr(msg.sampling, f), getattr(EVERY_FIELD, f)
        assert got == want and type(got) is type(want), f
    # The frame's object is the type's fields, named as the type names them: no mapping in between.
    assert set(json.loads(frame)["sampling"]) == set(SamplingParams.__struct_fields__)


def test_defaults_cross_as_nothing_and_come_back_as_defaults():
    frame = m.encode(m.AddRequest("r2", [1], SamplingParams()))
    assert json.loads(frame)["sampling"] == {}
    assert m.decode_to_engine(frame).sampling == SamplingParams()


def test_a_wrongly_typed_field_is_a_malformed_frame():
    frame = m.encode(m.AddRequest("r3", [1], SamplingParams())).replace(b'"sampling":{}', b'"sampling":{"top_k":"5"}')
    with pytest.raises(msgspec.ValidationError):
        m.decode_to_engine(frame)


def test_validated_params_are_what_the_engine_decodes():
    _, params = validate_request([1, 2], {"temperature": 0, "stop": "x", "top_k": 0, "max_new_tokens": 5}, LIMITS)
    back = m.decode_to_engine(m.encode(m.AddRequest("r4", [1, 2], params))).sampling
    assert back == params and back.temperature == 0.0 and back.stop == ["x"] and back.top_k == -1


def test_scoring_is_a_field_the_validation_sets():
    _, scoring = validate_request([1, 2], {"max_new_tokens": 0, "logprob_start_len": 0}, LIMITS)
    assert scoring.scoring and scoring.max_new_tokens == 0
    _, plain = validate_request([1, 2], {"max_new_tokens": 1}, LIMITS)
    assert not plain.scoring
    _, default = validate_request([1, 2], None, LIMITS)
    assert not default.scoring and default.max_new_tokens == 98  # (128 cut to what the context leaves)
    # A route that only scores asks for it, whatever the body's max_new_tokens.
    _, pooled = validate_request([1, 2], {"max_new_tokens": 7, "cache_salt": "s"}, LIMITS, scoring=True)
    assert pooled.scoring and pooled.max_new_tokens == 0 and pooled.cache_salt == "s"


def test_scoring_is_not_a_clients_field():
    with pytest.raises(ValidationError) as e:
        validate_request([1], {"scoring": True}, LIMITS)
    assert e.value.param == "scoring" and "unknown sampling parameter" in e.value.message


def test_the_engine_checks_typed_params_against_its_limits():
    assert check_typed_request([1, 2], SamplingParams(max_new_tokens=98), LIMITS) == [1, 2]
    with pytest.raises(ValidationError) as e:
        check_typed_request([1, 2], SamplingParams(max_new_tokens=99), LIMITS)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_new_tokens"
    with pytest.raises(ValidationError):
        check_typed_request([1, 256], SamplingParams(), LIMITS)
    for inconsistent in (SamplingParams(max_new_tokens=0), SamplingParams(max_new_tokens=3, scoring=True)):
        with pytest.raises(ValidationError) as e:
            check_typed_request([1, 2], inconsistent, LIMITS)
        assert e.value.param == "max_new_tokens"
