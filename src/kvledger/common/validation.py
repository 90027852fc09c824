"""The one validation of a generation request: the body's sampling fields become a ``SamplingParams``.

The front runs it on every route (``validate_request``); the engine process checks what it receives,
already typed, against its own limits (``check_typed_request``). A request that fails gets a
``ValidationError`` (HTTP 400, OpenAI error shape) before anything is allocated for it."""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import ValidationError
from .grammar_bounds import check_grammar_bounds, grammar_too_deep
from .limits import Limits
from .patterns import compile_pattern
from .sampling import DEFAULT_MAX_NEW_TOKENS, GRAMMAR_KINDS, SamplingParams

MAX_SEED = 2**63 - 1
MIN_PRIORITY, MAX_PRIORITY = -(2**63), 2**63 - 1  # SGLang's int priorities, as a 64-bit integer
MAX_CACHE_SALT_LEN = 1024  # vLLM's bound, for each of cache_salt and extra_key
MAX_LORA_NAME_LEN = 256
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is a mistake (or a string of digits), not a deadline


# The fields a client may send: ``scoring`` is the engine's, set from ``max_new_tokens`` 0 (below).
_FIELDS = set(SamplingParams.__struct_fields__) - {"scoring"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _bad(param: str, message: str, code: str = "invalid_value") -> ValidationError:
    return ValidationError(message, param=param, code=code)


def _number(d: dict, name: str, lo: float, hi: float, *, lo_open=False, hi_open=False) -> float | None:
    if name not in d or d[name] is None:
        return None
    v = d[name]
    if not _is_num(v) or not math.isfinite(v):
        raise _bad(name, f"{name} must be a finite number, got {v!r}")
    if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
        left, right = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise _bad(name, f"{name} must be in {left}{lo}, {hi}{right}, got {v!r}")
    return float(v)


def validate_input_ids(input_ids: Any, limits: Limits, param: str = "input_ids") -> list[int]:
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        raise _bad(param, "the prompt is empty; send at least one token", "empty_prompt")
    bad = next((t for t in input_ids if not _is_int(t) or not 0 <= t < limits.vocab_size), None)
    if bad is not None or any(not _is_int(t) for t in input_ids):
        raise _bad(
            param, f"token id {bad!r} is not an integer in [0, {limits.vocab_size})", "invalid_token_id"
        )
    return list(input_ids)


def validate_sampling(raw: dict | None, limits: Limits) -> SamplingParams:
    """Check every sampling parameter's type and range and return them as ``SamplingParams``."""
    d = dict(raw or {})
    if not isinstance(raw, (dict, type(None))):
        raise _bad("sampling_params", "sampling_params must be an object")
    # spaces_between_special_tokens: SGLang's detokenizer option, sent by its frontend; fast
    # tokenizers (all this engine loads) decide it themselves, so it is checked and has no effect.
    unknown = set(d) - _FIELDS - {"n", "max_tokens", "spaces_between_special_tokens"}
    if unknown:
        raise _bad(sorted(unknown)[0], f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    p = SamplingParams()
    if d.get("n") not in (None, 1):
        raise _bad("n", f"n must be 1 here, got {d['n']!r}; ask /v1/completions for several choices")
    if d.get("max_new_tokens") is not None:
        v = d["max_new_tokens"]
        if not _is_int(v) or v < 0:
            raise _bad("max_new_tokens", f"max_new_tokens must be an integer >= 0, got {v!r}")
        p.max_new_tokens = v
        p.scoring = v == 0  # the clients' spelling of scoring: the prompt's logprobs, no token drawn
    _numbers(d, p)
    _stops(d, p, limits)
    _tags(d, p, limits)
    _grammars(d, p, limits)
    return p


def _numbers(d: dict, p: SamplingParams) -> None:
    """The sampling distribution's numbers: temperature, top_p, top_k, min_p and the penalties."""
    if (v := _number(d, "temperature", 0.0, 100.0)) is not None:
        p.temperature = v
    if (v := _number(d, "top_p", 0.0, 1.0, lo_open=True)) is not None:
        p.top_p = v
    if d.get("top_k") is not None:
        v = d["top_k"]
        if not _is_int(v) or v < -1:
            raise _bad("top_k", f"top_k must be -1 (all), 0 (all) or a positive integer, got {v!r}")
        p.top_k = v if v > 0 else -1
    if (v := _number(d, "min_p", 0.0, 1.0)) is not None:
        p.min_p = v
    if (v := _number(d, "repetition_penalty", 0.0, 10.0, lo_open=True)) is not None:
        p.repetition_penalty = v
    if (v := _number(d, "frequency_penalty", -2.0, 2.0)) is not None:
        p.frequency_penalty = v
    if (v := _number(d, "presence_penalty", -2.0, 2.0)) is not None:
        p.presence_penalty = v


def _stops(d: dict, p: SamplingParams, limits: Limits) -> None:
    """What ends the output: stop strings, stop regexes, stop token ids, and min_new_tokens."""
    stop = d.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", "stop must be a string or a list of strings")
        if len(stop) > limits.max_stop_strings:
            raise _bad("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
        if any(not s or len(s) > limits.max_stop_string_len for s in stop):
            raise _bad("stop", f"stop strings must have 1 to {limits.max_stop_string_len} characters")
        p.stop = stop
    rx = d.get("stop_regex")
    if rx is not None and rx != []:
        rx = [rx] if isinstance(rx, str) else rx
        if not isinstance(rx, (list, tuple)) or not all(isinstance(r, str) and r for r in rx):
            raise _bad("stop_regex", "stop_regex must be a regular expression or a list of them")
        if len(rx) > limits.max_stop_strings or any(len(r) > limits.max_stop_string_len for r in rx):
            raise _bad(
                "stop_regex",
                f"at most {limits.max_stop_strings} stop regexes of at most {limits.max_stop_string_len} characters",
            )
        for r in rx:  # RE2 (linear time); a feature it lacks is refused, naming it
            compile_pattern(r, "stop_regex")
        p.stop_regex = list(rx)
    if d.get("min_new_tokens") is not None:
        v = d["min_new_tokens"]
        if not _is_int(v) or v < 0:
            raise _bad("min_new_tokens", f"min_new_tokens must be an integer >= 0, got {v!r}")
        p.min_new_tokens = v
    if d.get("spaces_between_special_tokens") not in (None, True, False):
        raise _bad("spaces_between_special_tokens", "spaces_between_special_tokens must be a boolean")
    ids = d.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > limits.max_stop_token_ids:
            raise _bad(
                "stop_token_ids", f"stop_token_ids must be a list of at most {limits.max_stop_token_ids}"
            )
        for t in ids:
            if not _is_int(t) or not 0 <= t < limits.vocab_size:
                raise _bad("stop_token_ids", f"stop token id {t!r} is not in [0, {limits.vocab_size})")
        p.stop_token_ids = list(ids)


def _tags(d: dict, p: SamplingParams, limits: Limits) -> None:
    """The rest, checked in turn: cache salt, adapter, timeout, priority, the flags, seed and logprobs."""
    salt = d.get("cache_salt")
    if salt is not None:
        # Up to cache_salt_of's pair of a cache_salt and an extra_key.
        if not isinstance(salt, str) or not 1 <= len(salt) <= 2 * MAX_CACHE_SALT_LEN + 8:
            raise _bad("cache_salt", f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_LEN} characters")
        p.cache_salt = salt
    lora = d.get("lora_path")
    if lora is not None:  # an adapter's name; the engine checks it is loaded
        if not isinstance(lora, str) or not 1 <= len(lora) <= MAX_LORA_NAME_LEN:
            raise _bad("lora_path", f"lora_path must be a LoRA adapter's name (1 to {MAX_LORA_NAME_LEN} characters)")
        p.lora_path = lora
    if d.get("timeout") is not None:
        p.timeout = validate_timeout(d["timeout"])
    if d.get("priority") is not None:
        v = d["priority"]
        if not _is_int(v) or not MIN_PRIORITY <= v <= MAX_PRIORITY:
            raise _bad("priority", f"priority must be an integer in [-2**63, 2**63-1], got {v!r}")
        p.priority = v
    for flag in ("ignore_eos", "logprobs", "skip_special_tokens", "no_stop_trim", "require_reasoning"):
        if d.get(flag) is not None:
            if not isinstance(d[flag], bool):
                raise _bad(flag, f"{flag} must be a boolean")
            setattr(p, flag, d[flag])
    if d.get("seed") is not None:
        v = d["seed"]
        if not _is_int(v) or not 0 <= v <= MAX_SEED:
            raise _bad("seed", f"seed must be an integer in [0, 2**63-1], got {v!r}")
        p.seed = v
    if d.get("top_logprobs") is not None:
        v = d["top_logprobs"]
        if not _is_int(v) or not 0 <= v <= limits.max_top_logprobs:
            raise _bad("top_logprobs", f"top_logprobs must be an integer in [0, {limits.max_top_logprobs}]")
        p.top_logprobs = v
    if d.get("logprob_start_len") is not None:
        v = d["logprob_start_len"]
        if not _is_int(v) or v < -1:
            raise _bad("logprob_start_len", f"logprob_start_len must be an integer >= -1, got {v!r}")
        p.logprob_start_len = v


def _grammars(d: dict, p: SamplingParams, limits: Limits) -> None:
    """Structured outputs (at most one grammar) and require_reasoning, which needs a reasoning parser."""
    grammars = [k for k in GRAMMAR_KINDS if d.get(k) is not None]
    if len(grammars) > 1:
        raise _bad(grammars[1], f"give at most one of json_schema, regex and ebnf, got {', '.join(grammars)}")
    for k in grammars:
        v = d[k]
        if k == "json_schema" and isinstance(v, dict):
            try:
                v = json.dumps(v)
            except RecursionError:  # deeper than Python's encoder goes: far past any bound
                raise grammar_too_deep(k, k, None, limits.max_grammar_depth) from None
            except (ValueError, TypeError):
                raise _bad(k, "json_schema must be a JSON object", "invalid_grammar") from None
        if not isinstance(v, str) or not v.strip():
            raise _bad(k, f"{k} must be a non-empty string" + (" or an object" if k == "json_schema" else ""))
        check_grammar_bounds(k, v, limits.max_grammar_len, limits.max_grammar_depth)
        setattr(p, k, v)
    if p.require_reasoning and limits.reasoning_parser is None:
        raise _bad(
            "require_reasoning",
            "require_reasoning needs a server started with --reasoning-parser (it knows the reasoning's end marker)",
        )


def validate_timeout(v: Any, param: str = "timeout") -> float:
    """A request's ``timeout``: seconds, a finite number in (0, a week]."""
    if not _is_num(v) or not math.isfinite(v) or not 0 < v <= MAX_TIMEOUT_S:
        raise _bad(param, f"{param} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {v!r}")
    return float(v)


def cache_salt_of(cache_salt: Any, extra_key: Any = None) -> str | None:
    """The request-level ``cache_salt`` (vLLM) and ``extra_key`` (SGLang) as one salt: requests share
    prefix-cache KV only when both are equal."""
    for name, v in (("cache_salt", cache_salt), ("extra_key", extra_key)):
        if v is not None and (not isinstance(v, str) or not 1 <= len(v) <= MAX_CACHE_SALT_LEN):
            raise _bad(name, f"{name} must be a string of 1 to {MAX_CACHE_SALT_LEN} characters")
    if cache_salt is None and extra_key is None:
        return None
    ek = extra_key or ""
    return f"{len(ek)}:{ek}{cache_salt or ''}"  # the length prefix keeps the pair unambiguous


def validate_request(
    input_ids: Any,
    sampling: dict | None,
    limits: Limits,
    *,
    default_max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS,
    max_param: str = "max_new_tokens",
    prompt_name: str = "prompt",
    scoring: bool = False,
) -> tuple[list[int], SamplingParams]:
    """The one validation: token ids, sampling parameters and context length.

    A prompt of ``context_length`` tokens or more is refused (code ``context_length_exceeded``). So
    is a ``max_new_tokens`` the client gave that does not fit in what the context leaves, with the
    numbers (as OpenAI, vLLM and SGLang answer; ``max_param`` and ``prompt_name`` are the client's
    names for the two). Without one, the request gets ``default_max_new_tokens`` (None: all the
    context leaves) cut to what the context leaves. ``scoring``: a route that only scores (the
    pooling routes) asks for a request that draws no token, whatever ``sampling`` says.
    """
    ids = validate_input_ids(input_ids, limits)
    params = validate_sampling(sampling, limits)
    if scoring:
        params.max_new_tokens, params.scoring = 0, True
    elif sampling is None or sampling.get("max_new_tokens") is None:
        left = limits.context_length - len(ids)  # (none: refused below, for the prompt)
        params.max_new_tokens = min(left if default_max_new_tokens is None else default_max_new_tokens, left)
    _check_context(ids, params, limits, max_param, prompt_name)
    return ids, params


def check_typed_request(input_ids: Any, params: SamplingParams, limits: Limits) -> list[int]:
    """The engine's check of a request the front validated (``validate_request``) and sent typed: its
    token ids and context length against the engine's own limits, and the scoring field's invariant."""
    ids = validate_input_ids(input_ids, limits)
    if params.scoring != (params.max_new_tokens == 0):
        raise _bad("max_new_tokens", "a scoring request draws no token, and only a scoring request draws none")
    _check_context(ids, params, limits)
    return ids


def _check_context(ids: list[int], p: SamplingParams, limits: Limits, max_param="max_new_tokens", prompt_name="prompt"):
    ctx, n = limits.context_length, len(ids)
    if n >= ctx:
        raise ValidationError(
            f"the prompt has {n} tokens; this model's context is {ctx} tokens "
            f"(prompt and output together), so the prompt must be shorter",
            param="input_ids",
            code="context_length_exceeded",
        )
    m = p.max_new_tokens  # the client's (a default was cut to what the context leaves)
    if n + m > ctx:
        raise ValidationError(
            f"This model's maximum context length is {ctx} tokens. However, you requested {n + m} "
            f"tokens ({n} in the {prompt_name}, {m} in the completion). Please reduce the length "
            f"of the {prompt_name} or completion.",
            param=max_param,
            code="context_length_exceeded",
        )
