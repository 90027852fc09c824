"""Request bodies (pydantic). Types are strict — "10" is not an int — and ranges are left to the one
validation function (``scheduler.validation``) so that the front and the engine agree."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    session_params: dict[str, Any] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAICommon(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[Any] | None = None
    stop_token_ids: list[Any] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    rid: str | None = None
    response_format: dict[str, Any] | None = None
    regex: str | None = None  # SGLang's and vLLM's extra structured-output fields
    ebnf: str | None = None


class CompletionRequest(_OpenAICommon):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_OpenAICommon):
    messages: list[ChatMessage] = Field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Strict):
    """vLLM's and SGLang's /tokenize: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Any]


class RidBody(_Strict):
    rid: str


class OpenSessionBody(_Strict):
    session_id: str | None = None
    streaming: bool = True
    timeout: float | None = None
    capacity_of_str_len: int | None = None  # SGLang's field; accepted and ignored


class CloseSessionBody(_Strict):
    session_id: str
