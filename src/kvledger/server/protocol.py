"""Request bodies (pydantic). Types are strict — "10" is not an int — and ranges are left to the one
validation function (``scheduler.validation``) so that the front and the engine agree. The fields
declared here are the implemented ones; peer fields that are not (``refused_fields``) and those read
elsewhere or without effect (``known_fields``) are sorted by ``fields.check_fields``."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..common.validation import cache_salt_of
from . import fields


class _Strict(BaseModel):
    """Every body type: strict types, peer fields kept for ``fields.check_fields``, and JSON null for
    an optional field meaning "not given" (OpenAI's schema marks them nullable, and the JS and Go SDKs,
    LangChain and curl scripts send null): the field takes its default. A required field stays
    required: null there is refused as missing."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or _required(cls, k)}


class _Salted(_Strict):
    """A body that runs prompts: its prefix-cache namespace is ``salt()``, the one derivation every
    such route uses (issue 50: /v1/score, /v1/rerank and /v1/responses dropped the salt, so a salted
    prefix was reusable, and timeable, by another tenant). Requests share cached KV only when their
    ``cache_salt`` (vLLM) and ``extra_key`` (SGLang) are both equal."""

    cache_salt: str | None = None
    extra_key: str | None = None

    def salt(self) -> str | None:
        return cache_salt_of(self.cache_salt, self.extra_key)


def _required(cls: type[BaseModel], name: str) -> bool:
    f = cls.model_fields.get(name)
    return f is not None and f.is_required()


class GenerateRequest(_Salted):
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
    priority: int | None = None  # SGLang's: used under --enable-priority-scheduling, ignored otherwise
    require_reasoning: bool = False  # SGLang: the output begins with reasoning; a grammar starts after it
    # SGLang's: images for the prompt's placeholder tokens (one prompt: an image or a list; a batch:
    # one entry per prompt), each a data: URL, base64 or an allowed local file (server/image_parts.py)
    image_data: Any = None
    # SGLang: the LoRA adapter (by name) of the prompt, or one per prompt of a batch (None: the base model)
    lora_path: str | list[str | None] | None = None

    refused_fields: ClassVar[fields.Refused] = fields.GENERATE_REFUSED
    known_fields: ClassVar[frozenset[str]] = fields.KNOWN_GENERATE


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM/SGLang: usage in every chunk

    known_fields: ClassVar[frozenset[str]] = frozenset({"include_obfuscation"})  # OpenAI's padding: none here


class _OpenAICommon(_Salted):
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
    stop_regex: str | list[Any] | None = None  # SGLang
    stop_token_ids: list[Any] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    user: str | None = None  # a tag: no effect (as in vLLM)
    rid: str | None = None
    request_id: str | None = None  # vLLM's name for rid
    response_format: dict[str, Any] | None = None
    regex: str | None = None  # SGLang's and vLLM's extra structured-output fields
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None  # SGLang
    min_tokens: int | None = None  # vLLM/SGLang: min_new_tokens
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None  # SGLang; vLLM's include_stop_str_in_output
    include_stop_str_in_output: bool | None = None
    timeout: float | None = None  # seconds, queued and running together (sampling.SamplingParams.timeout)
    priority: int | None = None  # SGLang's convention (vLLM's is reversed); ignored without priority scheduling


class CompletionRequest(_OpenAICommon):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    refused_fields: ClassVar[fields.Refused] = fields.COMPLETIONS_REFUSED
    known_fields: ClassVar[frozenset[str]] = fields.KNOWN_OPENAI


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # An assistant turn's reasoning, given back to templates that render it (SGLang's and vLLM's names).
    reasoning_content: str | None = None
    reasoning: str | None = None

    refused_fields: ClassVar[fields.Refused] = {"audio": (None,), "function_call": (None,)}
    known_fields: ClassVar[frozenset[str]] = frozenset({"refusal"})  # OpenAI's answer echoed back


class ChatRequest(_OpenAICommon):
    messages: list[ChatMessage] = Field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # The prompt: vLLM's template controls (SGLang has the first and the kwargs too).
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None  # default: True, unless continue_final_message
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None  # passed to the template (enable_thinking: not "none")
    # SGLang's, with --reasoning-parser (no effect without one): false keeps the reasoning in content;
    # stream_reasoning false sends it in one delta once complete instead of as it comes.
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    refused_fields: ClassVar[fields.Refused] = fields.CHAT_REFUSED
    known_fields: ClassVar[frozenset[str]] = fields.KNOWN_CHAT


class ResponsesRequest(_Salted):
    """OpenAI's ``POST /v1/responses``: served on the chat path (``responses.py`` converts)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    user: str | None = None  # a tag: no effect
    priority: int | None = None  # vLLM's and SGLang's extra (as on chat)

    refused_fields: ClassVar[fields.Refused] = fields.RESPONSES_REFUSED
    known_fields: ClassVar[frozenset[str]] = fields.KNOWN_OPENAI


class EmbeddingRequest(_Salted):
    """OpenAI's ``POST /v1/embeddings`` (``input``: a string, strings, token ids or lists of them), or
    vLLM's chat form (``messages``, image parts included, through the chat template)."""

    model: str | None = None
    input: Any = None  # checked by the one prompt parser (pooling_api.py), so errors name "input"
    messages: list[ChatMessage] | None = None  # vLLM's: one prompt, the chat template's rendering
    add_generation_prompt: bool = False  # (vLLM's default for an embedding's chat prompt)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # refused: the model is not Matryoshka-trained
    user: str | None = None  # a tag: no effect
    rid: str | None = None
    request_id: str | None = None  # vLLM's name for rid

    refused_fields: ClassVar[fields.Refused] = fields.EMBEDDINGS_REFUSED
    known_fields: ClassVar[frozenset[str]] = fields.KNOWN_OPENAI


class ScoreRequest(_Salted):
    """SGLang's ``POST /v1/score``: per item, the probabilities of ``label_token_ids`` right after
    ``query + item`` (``item + query`` with ``item_first``)."""

    model: str | None = None
    query: str | list[Any] | None = None
    items: str | list[Any] | None = None
    label_token_ids: list[Any] | None = None
    apply_softmax: bool = False
    item_first: bool = False

    refused_fields: ClassVar[fields.Refused] = fields.SCORE_REFUSED
    known_fields: ClassVar[frozenset[str]] = fields.KNOWN_OPENAI


class RerankRequest(_Salted):
    """``POST /v1/rerank`` (SGLang's and vLLM's fields): ``documents`` ordered by their relevance to
    ``query``, here the cosine similarity of their embeddings."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0 (vLLM's default): all of them
    return_documents: bool = True

    refused_fields: ClassVar[fields.Refused] = fields.RERANK_REFUSED
    known_fields: ClassVar[frozenset[str]] = fields.KNOWN_OPENAI


class TokenizeRequest(_Strict):
    """vLLM's and SGLang's /tokenize: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    refused_fields: ClassVar[fields.Refused] = {
        "return_token_strs": (None, False), "tools": (None, []), "chat_template": (None,),
        "mm_processor_kwargs": (None, {}),
    }  # fmt: skip


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Any]


class RidBody(_Strict):
    rid: str

    refused_fields: ClassVar[fields.Refused] = {"abort_all": (None, False)}  # SGLang's


class PauseGenerationBody(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"  # SGLang's modes and default


class ContinueGenerationBody(_Strict):
    known_fields: ClassVar[frozenset[str]] = frozenset({"torch_empty_cache"})  # a CUDA allocator hint


class LoadLoraBody(_Strict):
    """SGLang's and vLLM's ``/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str

    refused_fields: ClassVar[fields.Refused] = {"pinned": (None, False), "load_inplace": (None, False)}


class UnloadLoraBody(_Strict):
    """SGLang's and vLLM's ``/unload_lora_adapter`` body."""

    lora_name: str
    lora_int_id: int | None = None  # vLLM's: ignored (the name identifies the adapter)


class UpdateWeightsBody(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False

    # SGLang's other fields: a weight version tag, async or partial updates, keeping the stale cache.
    refused_fields: ClassVar[fields.Refused] = {
        "weight_version": (None,), "is_async": (None, False), "keep_pause": (None, False),
        "token_step": (None, 0), "flush_cache": (None, True), "manifest": (None,),
    }  # fmt: skip
    known_fields: ClassVar[frozenset[str]] = frozenset({"torch_empty_cache", "recapture_cuda_graph"})


class OpenSessionBody(_Strict):
    session_id: str | None = None
    streaming: bool = True
    timeout: float | None = None
    capacity_of_str_len: int | None = None  # SGLang's field; accepted and ignored


class CloseSessionBody(_Strict):
    session_id: str
