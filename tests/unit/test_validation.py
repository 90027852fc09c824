"""One validation function: every bad input is a 400 with a named parameter, and allocates nothing."""

from __future__ import annotations

import pytest

from kvledger import ValidationError
from kvledger.common import Limits, validate_request

LIMITS = Limits(vocab_size=256, context_length=100)

BAD = [
    ([], {}, "input_ids"),
    ([1, 2, 256], {}, "input_ids"),
    ([1, -1], {}, "input_ids"),
    ([1, 2.5], {}, "input_ids"),
    ([1, True], {}, "input_ids"),
    ("abc", {}, "input_ids"),
    ([1], {"temperature": -1}, "temperature"),
    ([1], {"temperature": float("nan")}, "temperature"),
    ([1], {"temperature": "1"}, "temperature"),
    ([1], {"top_p": 0}, "top_p"),
    ([1], {"top_p": 1.5}, "top_p"),
    ([1], {"top_k": -2}, "top_k"),
    ([1], {"top_k": 1.5}, "top_k"),
    ([1], {"min_p": 2}, "min_p"),
    ([1], {"max_new_tokens": -1}, "max_new_tokens"),
    ([1], {"max_new_tokens": "10"}, "max_new_tokens"),
    ([1], {"seed": 2**64}, "seed"),
    ([1], {"seed": -1}, "seed"),
    ([1], {"top_logprobs": 21}, "top_logprobs"),
    ([1], {"stop_token_ids": [256]}, "stop_token_ids"),
    ([1], {"stop": ["x"] * 17}, "stop"),
    ([1], {"stop": [""]}, "stop"),
    ([1], {"stop": [1]}, "stop"),
    ([1], {"repetition_penalty": 0}, "repetition_penalty"),
    ([1], {"frequency_penalty": 3}, "frequency_penalty"),
    ([1], {"ignore_eos": "yes"}, "ignore_eos"),
    ([1], {"bogus": 1}, "bogus"),
    ([1] * 100, {}, "input_ids"),
]


@pytest.mark.parametrize("ids,sp,param", BAD, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_inputs_name_their_parameter(ids, sp, param):
    with pytest.raises(ValidationError) as e:
        validate_request(ids, sp, LIMITS)
    assert e.value.param == param and e.value.status == 400
    body = e.value.to_dict()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]


def test_context_length_code_and_clamp():
    with pytest.raises(ValidationError) as e:
        validate_request([1] * 100, {}, LIMITS)
    assert e.value.code == "context_length_exceeded"
    # A default is cut to what the context leaves; None: all of it.
    _, p = validate_request([1] * 90, {}, LIMITS)
    assert p.max_new_tokens == 10
    _, p = validate_request([1] * 30, {}, LIMITS, default_max_new_tokens=None)
    assert p.max_new_tokens == 70
    _, p = validate_request([1] * 30, {}, LIMITS, default_max_new_tokens=16)
    assert p.max_new_tokens == 16
    _, p = validate_request([1] * 90, {"max_new_tokens": 10}, LIMITS)
    assert p.max_new_tokens == 10


def test_max_new_tokens_beyond_the_context_is_refused_with_the_numbers():
    """As OpenAI, vLLM and SGLang: a length the client asked for that does not fit is a 400."""
    with pytest.raises(ValidationError) as e:
        validate_request([1] * 90, {"max_new_tokens": 11}, LIMITS, max_param="max_tokens", prompt_name="messages")
    err = e.value
    assert err.code == "context_length_exceeded" and err.param == "max_tokens" and err.status == 400
    assert err.message == (
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens "
        "(90 in the messages, 11 in the completion). Please reduce the length of the messages or completion."
    )


def test_good_request_normalised():
    ids, p = validate_request([1, 2], {"stop": "x", "top_k": 0, "seed": 2**63 - 1, "temperature": 0}, LIMITS)
    assert ids == [1, 2] and p.stop == ["x"] and p.top_k == -1 and p.seed == 2**63 - 1


def test_invalid_engine_call_allocates_nothing(make_engine):
    eng = make_engine()
    before = eng.memory()
    with pytest.raises(ValidationError):
        eng.generate(input_ids=[[1, 2, 3], [1, 999]], sampling_params={"max_new_tokens": 3})
    assert eng.memory() == before and not eng.core.scheduler.reqs
