"""Sampling parameters (SGLang's names): one type from the HTTP body's validation to the sampler.

``SamplingParams`` is built once, by the one validation (``validation.validate_sampling``), and the
same object travels on: the front sends it to the engine process inside ``messages.AddRequest``
(msgspec encodes and decodes the struct itself, field by field: there is no hand-written mapping),
the engine keeps it on the ``Req``, and the sampler reads it from each ``SamplingRow``. A new
sampling field is declared here, checked in ``validation.py`` and read where it acts.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")  # structured outputs; a request takes at most one
DEFAULT_MAX_NEW_TOKENS = 128  # /generate's and the offline Engine's (SGLang's)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request's sampling parameters, already validated (see ``validation.validate_sampling``).

    A msgspec struct so that it is its own wire format (``messages.py``); mutable because the
    engine narrows a few fields at intake (a session turn's ``max_new_tokens``, PD's halves)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_regex: list[str] = msgspec.field(default_factory=list)  # SGLang: end when the output matches one
    min_new_tokens: int = 0  # EOS and stop tokens are not drawn before this many tokens
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # SGLang: keep the matched stop string in the text (vLLM's include_stop_str_in_output)
    # Prompt logprobs (scoring): the logprob of every prompt token from this index on (the first
    # token's is None); -1: none. Positions asked for are computed, never taken from a cache.
    logprob_start_len: int = -1
    # Structured outputs (at most one): a JSON schema as text, a regular expression, an EBNF grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Not a sampling choice but it travels with them: requests with different salts never share
    # prefix-cache KV (vLLM's ``cache_salt``, SGLang's ``extra_key``); None shares with every unsalted one.
    cache_salt: str | None = None
    # Nor is this: the LoRA adapter (by name) the request runs with; None: the base model. Its KV is
    # cached under the adapter's namespace (``memory/cache_key.py``), never shared with another's.
    lora_path: str | None = None
    # Nor is this: seconds the request may take from its arrival at the engine, queued and running
    # together; past it the request ends through the release path with a 503 (None: no limit of its own;
    # the server's --request-timeout-s, if set, still applies: the shorter one wins).
    timeout: float | None = None
    # Nor is this: the request's place in the queue under --enable-priority-scheduling (SGLang's field
    # and convention: larger is more important unless --schedule-low-priority-values-first); ignored
    # otherwise. None: the least important value.
    priority: int | None = None
    # Nor this (SGLang's ``require_reasoning``): the output begins with the model's reasoning, so a
    # grammar above starts only once the reasoning's end marker (``</think>``) is generated. Needs a
    # server with a reasoning parser (``--reasoning-parser``), which knows the marker's token ids.
    require_reasoning: bool = False
    # The request draws no token: it runs its prompt for the prompt's logprobs (or a pooling
    # request's embedding or labels) and ends with finish reason "length". Set by the validation
    # when the client asks for 0 new tokens (SGLang's /generate and OpenAI's completions spell
    # scoring that way; a chat with max_tokens 0 is the same request) and by the pooling routes;
    # never a client's field. Always with ``max_new_tokens == 0`` (``validation.check_typed_request``).
    scoring: bool = False

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty or self.presence_penalty)


@dataclass(slots=True)
class SamplingRow:
    """One token to draw for one request. ``position`` is the index in the output of the token drawn:
    a seeded request's randomness comes from ``(seed, position)`` alone, so its output does not
    depend on the batch, a retraction, the process or speculation. ``prompt_ids``/``output_ids``
    (the history before ``position``) are given only when the request uses penalties."""

    params: SamplingParams
    position: int
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
