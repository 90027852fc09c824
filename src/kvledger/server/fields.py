"""The rule for request fields: a field that OpenAI, SGLang or vLLM defines is implemented or refused
with a 400 naming it; a field nobody defines is ignored with a warning in the log (as vLLM does).

Implemented fields are declared on the pydantic bodies (``protocol.py``); everything else lands in a
body's ``model_extra`` and is sorted here, once, for every route (``handlers.parse_body``):

* ``refused``: peer fields this server does not implement, each with the values that ask for nothing
  (their defaults): sent with such a value it is accepted, with any other it is a 400
  ``unsupported_parameter`` naming it;
* ``known``: peer fields read elsewhere (PD's bootstrap room) or that change nothing in the answer
  (user tags, logging and routing hints);
* anything else: unknown, logged as ignored.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from ..errors import ValidationError

log = logging.getLogger("kvledger.server")

Refused = dict[str, tuple[Any, ...]]  # field -> the values that ask for nothing

_NONE = (None,)
_OFF = (None, False)
_EMPTY = (None, [], {})

# Peer fields with no effect on the answer here, or read by another module.
KNOWN_OPENAI = frozenset(
    {
        "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",  # OpenAI: tags, hints
        "return_token_offsets", "return_mm_kwargs",  # vLLM: only read by its /render endpoints
        "bootstrap_host", "bootstrap_port", "bootstrap_room",  # PD: common/disagg.py
        "no_logs", "conversation_id", "routing_key",  # SGLang: logging, tracking, routing hints
    }
)  # fmt: skip
KNOWN_CHAT = KNOWN_OPENAI
KNOWN_GENERATE = KNOWN_OPENAI | {
    "log_metrics", "bootstrap_pair_key", "decode_tp_size", "received_time",
    "model",  # SGLang's router adds it to what it forwards to /generate
}  # fmt: skip

_OPENAI_REFUSED: Refused = {
    # OpenAI
    "logit_bias": _EMPTY, "functions": _EMPTY, "function_call": _NONE, "audio": _NONE,
    "modalities": (None, ["text"]), "prediction": _NONE, "web_search_options": _NONE, "verbosity": _NONE,
    "store": _OFF, "service_tier": (None, "auto", "default"),
    # vLLM
    "use_beam_search": _OFF, "length_penalty": (None, 1.0), "watermarking": _OFF,
    "truncate_prompt_tokens": _NONE, "truncation_side": _NONE, "prompt_logprobs": _NONE,
    "logprob_token_ids": _NONE, "allowed_token_ids": _NONE, "bad_words": _EMPTY,
    "structured_outputs": _NONE, "guided_json": _NONE, "guided_regex": _NONE, "guided_choice": _NONE,
    "guided_grammar": _NONE, "guided_decoding_backend": _NONE, "guided_whitespace_pattern": _NONE,
    "structural_tag": _NONE, "return_tokens_as_token_ids": _OFF, "return_token_ids": _OFF,
    "return_prompt_text": _OFF, "kv_transfer_params": _NONE, "ec_transfer_params": _NONE,
    "vllm_xargs": _NONE, "repetition_detection": _NONE, "thinking_token_budget": (None, -1),
    "stream_interval": _NONE, "prompt_embeds": _NONE, "mm_processor_kwargs": _EMPTY,
    "media_io_kwargs": _EMPTY, "routed_experts_prompt_start": (None, 0),
    # SGLang (and vLLM's session_id, which means another thing there)
    "session_id": _NONE, "session_params": _NONE, "lora_path": _NONE,
    "return_hidden_states": _OFF, "return_routed_experts": _OFF, "routed_experts_start_len": (None, 0),
    "return_cached_tokens_details": _OFF, "custom_logit_processor": _NONE, "custom_params": _NONE,
    "custom_labels": _NONE, "images_config": _NONE, "ngram_corpus_id": _NONE,
    "routed_dp_rank": (None, 0), "data_parallel_rank": (None, 0), "disagg_prefill_dp_rank": (None, 0),
}  # fmt: skip

COMPLETIONS_REFUSED: Refused = {**_OPENAI_REFUSED, "add_special_tokens": (None, True)}

CHAT_REFUSED: Refused = {
    **_OPENAI_REFUSED,
    "add_special_tokens": _OFF,  # the chat template writes the special tokens
    "echo": _OFF, "chat_template": _NONE,  # vLLM: no client-supplied Jinja
    # Dropping the reasoning from the answer (vLLM's include_reasoning: false) is not implemented:
    # with --reasoning-parser it is split into reasoning_content (SGLang's separate_reasoning).
    "include_reasoning": (None, True), "reasoning": _NONE,
    "return_prompt_token_ids": _OFF, "return_meta_info": _OFF, "input_ids": _NONE, "task": _NONE,
    "max_dynamic_patch": _NONE, "min_dynamic_patch": _NONE, "use_audio_in_video": _OFF,
}  # fmt: skip

# OpenAI's Responses fields (and vLLM's/SGLang's extras there) that /v1/responses does not implement.
RESPONSES_REFUSED: Refused = {
    "background": _OFF, "conversation": _NONE, "include": _EMPTY, "max_tool_calls": _NONE, "prompt": _NONE,
    "reasoning": _NONE, "service_tier": (None, "auto", "default"), "stream_options": _NONE,
    "top_logprobs": (None, 0), "truncation": (None, "disabled"), "context_management": _NONE,
    "background_options": _NONE, "access_programs": _NONE, "image": _NONE, "moderation": _NONE,
    "prompt_cache_options": _NONE,
    # vLLM / SGLang extras on their Responses bodies
    "top_k": (None, -1, 0), "min_p": (None, 0.0), "repetition_penalty": (None, 1.0), "seed": _NONE,
    "stop": _EMPTY, "ignore_eos": _OFF, "request_id": _NONE,
    "enable_response_messages": _OFF, "previous_input_messages": _EMPTY, "skip_special_tokens": (None, True),
    "include_stop_str_in_output": _OFF, "logit_bias": _EMPTY, "mm_processor_kwargs": _EMPTY,
    "chat_template_kwargs": _EMPTY, "structured_outputs": _NONE, "kv_transfer_params": _NONE,
    "frequency_penalty": (None, 0.0), "presence_penalty": (None, 0.0), "max_tokens": _NONE,
    "session_id": _NONE, "lora_path": _NONE, "rid": _NONE,
}  # fmt: skip

# vLLM's and SGLang's extras on their pooling bodies (embeddings, score, rerank) not implemented here.
_POOLING_REFUSED: Refused = {
    "truncate_prompt_tokens": (None, -1), "priority": (None, 0), "normalize": (None, True),
    "use_activation": (None, True), "softmax": _NONE, "activation": _NONE, "mm_processor_kwargs": _EMPTY,
    "embed_dtype": (None, "float32"), "endianness": (None, "native", "little"), "dimensions_from": _NONE,
    "lora_path": _NONE, "additional_data": _NONE, "encoding_format_options": _NONE, "messages": _NONE,
    "chat_template": _NONE, "chat_template_kwargs": _EMPTY, "add_generation_prompt": _OFF,
    "continue_final_message": _OFF, "image": _NONE, "routed_dp_rank": (None, 0),
}  # fmt: skip
EMBEDDINGS_REFUSED: Refused = {
    **{k: v for k, v in _POOLING_REFUSED.items() if k not in ("messages", "add_generation_prompt")},
    "add_special_tokens": (None, True),
}  # (the chat form, ``messages``, is served: pooling_api.py)
SCORE_REFUSED: Refused = {**_POOLING_REFUSED, "text_1": _NONE, "text_2": _NONE, "data_1": _NONE, "data_2": _NONE}
RERANK_REFUSED: Refused = {**_POOLING_REFUSED, "instruct": _NONE, "instruction": _NONE}

GENERATE_REFUSED: Refused = {
    "input_embeds": _NONE, "video_data": _EMPTY, "audio_data": _EMPTY,
    "use_audio_in_video": _OFF, "token_ids_logprob": _EMPTY, "return_hidden_states": _OFF,
    "return_routed_experts": _OFF, "return_indexer_topk": _OFF, "routed_experts_start_len": (None, 0),
    "modalities": _EMPTY, "lora_id": _NONE, "custom_logit_processor": _NONE,
    "positional_embed_overrides": _NONE, "routed_dp_rank": (None, 0),
    "data_parallel_rank": (None, 0), "disagg_prefill_dp_rank": (None, 0), "background": _OFF,
    "custom_labels": _NONE, "return_bytes": _OFF, "return_entropy": _OFF,
    "external_trace_header": _NONE, "need_wait_for_mm_inputs": _OFF, "num_items_assigned": _NONE,
    "max_dynamic_patch": _NONE, "min_dynamic_patch": _NONE, "image_max_dynamic_patch": _NONE,
    "video_max_dynamic_patch": _NONE, "multi_item_delimiter_indices": _NONE,
}  # fmt: skip


def _kind(v: Any) -> Any:
    # A bool is an int in Python: True must not pass for 1 where a number is neutral (nor 0 for False).
    return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v)


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    return value is None or any(_kind(value) == _kind(n) and value == n for n in neutral if n is not None)


def check_fields(body: BaseModel) -> None:
    """Refuse the peer fields ``body``'s type does not implement; log the unknown ones. The models
    inside it (messages, stream options) are checked the same way."""
    for name in type(body).model_fields:
        value = getattr(body, name)
        for item in value if isinstance(value, list) else (value,):
            if isinstance(item, BaseModel):
                check_fields(item)
    extra = body.model_extra or {}
    if not extra:
        return
    refused: Refused = getattr(type(body), "refused_fields", {})
    known: frozenset[str] = getattr(type(body), "known_fields", frozenset())
    unknown = []
    for name, value in extra.items():
        if name in refused:
            if not _asks_nothing(value, refused[name]):
                raise ValidationError(
                    f"{name} is not supported by this server; leave it out", param=name, code="unsupported_parameter"
                )
        elif name not in known:
            unknown.append(name)
    if unknown:
        log.warning("ignoring unknown field(s) of a %s: %s", type(body).__name__, ", ".join(sorted(unknown)))
