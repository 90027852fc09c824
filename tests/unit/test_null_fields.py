"""JSON null for an optional field means "not given" on every body type (issue 56): OpenAI's schema
marks those fields nullable and the JS and Go SDKs, LangChain and curl scripts send null. One rule in
the body types (``protocol._Strict``), walked here over every optional field of every type; a
required field stays required."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from kvledger.server import protocol
from kvledger.server.fields import check_fields

# The least body each type takes: the walk adds one null field at a time to it.
MINIMAL: dict[type[BaseModel], dict] = {
    protocol.GenerateRequest: {"text": "hi"},
    protocol.StreamOptions: {},
    protocol.CompletionRequest: {"prompt": "hi"},
    protocol.ChatMessage: {"role": "user", "content": "hi"},
    protocol.ChatRequest: {"messages": [{"role": "user", "content": "hi"}]},
    protocol.ResponsesRequest: {"input": "hi"},
    protocol.EmbeddingRequest: {"input": "hi"},
    protocol.ScoreRequest: {"query": "a", "items": ["b"], "label_token_ids": [1]},
    protocol.RerankRequest: {"query": "a", "documents": ["b"]},
    protocol.TokenizeRequest: {"prompt": "hi"},
    protocol.DetokenizeRequest: {"tokens": [1]},
    protocol.RidBody: {"rid": "r"},
    protocol.PauseGenerationBody: {},
    protocol.ContinueGenerationBody: {},
    protocol.LoadLoraBody: {"lora_name": "a", "lora_path": "/p"},
    protocol.UnloadLoraBody: {"lora_name": "a"},
    protocol.UpdateWeightsBody: {"model_path": "/p"},
    protocol.OpenSessionBody: {},
    protocol.CloseSessionBody: {"session_id": "s"},
}


def body_types() -> set[type[BaseModel]]:
    """Every body type the routes parse (all of them subclasses of the one strict base)."""
    out, todo = set(), [protocol._Strict]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if not sub.__name__.startswith("_"):
                out.add(sub)
    return out


def optional_fields(t: type[BaseModel]) -> list[str]:
    """Declared fields with a default, and the peer fields the type refuses or knows (null for
    those asks for nothing either)."""
    declared = [n for n, f in t.model_fields.items() if not f.is_required()]
    extra = sorted(set(getattr(t, "refused_fields", {})) | set(getattr(t, "known_fields", ())))
    return declared + [n for n in extra if n not in t.model_fields]


def test_every_body_type_is_walked():
    assert body_types() == set(MINIMAL), "a new body type needs its minimal body here"


@pytest.mark.parametrize("t", sorted(MINIMAL, key=lambda t: t.__name__), ids=lambda t: t.__name__)
def test_null_for_an_optional_field_is_its_default(t):
    for name in optional_fields(t):
        unset = t.model_validate({k: v for k, v in MINIMAL[t].items() if k != name})
        got = t.model_validate({**MINIMAL[t], name: None})
        check_fields(got)  # a refused peer field sent as null asks for nothing: no 400
        assert got.model_dump() == unset.model_dump(), name


@pytest.mark.parametrize("t", sorted(MINIMAL, key=lambda t: t.__name__), ids=lambda t: t.__name__)
def test_null_for_a_required_field_is_still_refused(t):
    for name, f in t.model_fields.items():
        if f.is_required():
            with pytest.raises(PydanticValidationError):
                t.model_validate({**MINIMAL[t], name: None})


def test_nested_bodies_take_null_too():
    body = protocol.ChatRequest.model_validate({
        "messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": None}],
        "stream": None, "n": None, "logprobs": None, "stream_options": {"include_usage": None},
    })  # fmt: skip
    assert body.stream is False and body.n == 1 and body.logprobs is False
    assert body.stream_options is not None and body.stream_options.include_usage is False
    # A wrong type is still refused: only null means "not given".
    with pytest.raises(PydanticValidationError):
        protocol.ChatRequest.model_validate({"messages": [], "stream": "yes"})
