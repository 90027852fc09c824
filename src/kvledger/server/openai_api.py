"""OpenAI-compatible /v1/completions and /v1/chat/completions on top of ``Generator``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..common import SamplingParams, parse_prompts, validate_request
from ..common.disagg import parse_disagg
from ..common.prompts import split_openai_prompt
from ..common.reasoning import REASONING_FORMATS
from ..common.sampling import GRAMMAR_KINDS
from ..constrained.grammar import ANY_JSON
from ..errors import NotFoundError, ValidationError, error_body
from ..model.chat_templates import no_template_message
from .admission import AdmissionLimits, check_fanout, check_prompt_tokens, prompt_count
from .generation import GenerationService, GenState
from .protocol import ChatRequest, CompletionRequest, _OpenAICommon
from .reasoning import ReasoningParser
from .tool_grammar import tool_call_grammar
from .tools import ToolCall, ToolParser, check_tools, make_parser, render_messages


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default, which SGLang and vLLM keep
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # "max": SGLang's
# apply_chat_template's own arguments: chat_template_kwargs may not reach them (a client's template).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


# The OpenAI bodies' fields that carry a sampling parameter under its own name: taken by name, so a
# sampling field declared on the body (protocol.py) with the type's name needs nothing here. The
# others (cache_salt: the salt; no_stop_trim: two spellings) are renamed or derived below.
_BY_NAME = tuple(
    f for f in SamplingParams.__struct_fields__
    if f in _OpenAICommon.model_fields and f not in ("cache_salt", "no_stop_trim")
)  # fmt: skip


def sampling_dict(body: _OpenAICommon, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> dict:
    """OpenAI fields -> SGLang sampling params (range checks happen in the one validation). Without
    ``max_tokens`` there is no ``max_new_tokens``: the endpoint's default applies (``validate_request``)."""
    rf = response_format_grammar(body.response_format)
    if rf and body.json_schema is not None:
        raise ValidationError("give json_schema or response_format, not both", param="json_schema")
    trims = [v for v in (body.no_stop_trim, body.include_stop_str_in_output) if v is not None]
    d: dict[str, Any] = {name: getattr(body, name) for name in _BY_NAME}
    d.update(rf)
    d.update(
        max_new_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        min_new_tokens=body.min_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        no_stop_trim=any(trims) if trims else None,
        cache_salt=body.salt(),
    )
    return {k: v for k, v in d.items() if v is not None}


def response_format_grammar(rf: dict | None) -> dict:
    """OpenAI ``response_format`` -> the sampling param that constrains the output."""
    if rf is None:
        return {}
    kind = rf.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": ANY_JSON}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ValidationError(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return {"json_schema": json.dumps(schema)}
    raise ValidationError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param="response_format.type",
    )


def text_parts(content: list[dict]) -> list[str]:
    """The text of a message's content parts (``[{"type": "text", "text": ...}]``): this server reads
    text only, so another kind of part is refused rather than dropped."""
    out = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValidationError(
                f"message content parts must be {{\"type\": \"text\", \"text\": string}}; got {str(part)[:80]}",
                param="messages",
            )
        out.append(part["text"])
    return out


def finish_reason(st: GenState) -> str | None:
    return None if st.finish is None else st.finish.type


def split_calls(tools: ToolParser, text: str, st: GenState) -> tuple[str, list[ToolCall] | None]:
    """A completion's content and complete tool calls so far. One cut by ``max_tokens`` or the
    context keeps only its complete calls: the call the limit cut is dropped, never shown as content
    (and the finish reason stays ``length``: ``tool_finish_reason``)."""
    return tools.split(text, st.finished, cut=st.finish is not None and st.finish.type == "length")


def tool_finish_reason(st: GenState, calls) -> str | None:
    """``tool_calls`` when the model ended its turn with calls; any other end (a limit) says itself."""
    fr = finish_reason(st)
    return "tool_calls" if calls and fr == "stop" else fr


def matched_stop(st: GenState) -> int | str | None:
    """SGLang's ``matched_stop``: the stop token id, stop string or stop_regex pattern that ended the choice."""
    return st.finish.matched if st.finish is not None and st.finish.type == "stop" else None


@dataclass
class ChatJob:
    """One chat request, ready to run: what ``/v1/chat/completions`` and ``/v1/responses`` share."""

    ids: list[int]
    params: SamplingParams
    tools: ToolParser | None  # None without tools
    reasoning: ReasoningParser | None  # None without a reasoning parser, or with separate_reasoning false


class OpenAIServing:
    def __init__(
        self,
        gen: GenerationService,
        name: str,
        aliases: set[str],
        limits,
        tokenizer,
        max_n: int,
        tool_parser: ToolParser | None = None,
        reasoning_parser: str | None = None,
        admission: AdmissionLimits | None = None,
    ):
        self.gen = gen
        self.admission = admission or AdmissionLimits()
        self.tool_parser = tool_parser or make_parser("hermes")
        self.reasoning_format = REASONING_FORMATS[reasoning_parser] if reasoning_parser else None
        template = getattr(tokenizer, "chat_template", None) or ""
        self.template_has_tools = "tools" in template
        self.name = name
        self.model_names = {name} | aliases
        # The LoRA adapters served now (names), each a model of its own to the OpenAI API.
        self.adapters: Callable[[], set[str]] = set
        self.limits = limits
        self.tokenizer = tokenizer
        self.max_n = max_n

    def check_model(self, model: str | None, adapters: bool = False) -> str | None:
        """404 unless ``model`` is the served model (or an alias), or with ``adapters`` one of its
        LoRA adapters; returns the adapter's name (None: the base model)."""
        if model is None or model in self.model_names:
            return None
        if adapters and model in self.adapters():
            return model
        raise NotFoundError(
            f"the model {model!r} does not exist; this server serves {self.name!r}"
            + (f" and the LoRA adapters {', '.join(sorted(self.adapters()))}" if adapters and self.adapters() else ""),
            param="model",
            code="model_not_found",
        )

    def answer_model(self, requested: str | None) -> str:
        """The ``model`` an answer names: the adapter the request named, else the served name (an
        alias or no model at all answers as the served model)."""
        return requested if requested is not None and requested in self.adapters() else self.name

    def _check_common(self, body: _OpenAICommon) -> str | None:
        """The model check (an adapter's name selects it: returned) and ``n``'s range."""
        lora = self.check_model(body.model, adapters=True)
        if not 1 <= body.n <= self.max_n:
            raise ValidationError(f"n must be in [1, {self.max_n}], got {body.n}", param="n")
        return lora

    def completion_inputs(self, body: CompletionRequest) -> list[list[int]]:
        """The prompts' token ids, after the body's fan-out is checked (before any is tokenized) and
        with their total checked (issue 50: one body of 20,000 prompts x n=4)."""
        check_fanout(self.admission, prompt_count(body.prompt), body.n, "prompt")
        text, ids = split_openai_prompt(body.prompt)
        prompts = parse_prompts(text, ids, self.tokenizer, text_param="prompt")[0]
        check_prompt_tokens(self.admission, prompts, "prompt")
        return prompts

    async def completions(self, body: CompletionRequest, disconnected) -> dict | AsyncIterator[str]:
        lora = self._check_common(body)
        if body.suffix is not None:
            raise ValidationError("suffix is not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise ValidationError("best_of other than n is not supported", param="best_of")
        if body.logprobs is not None and not (isinstance(body.logprobs, int) and 0 <= body.logprobs <= 20):
            raise ValidationError("logprobs must be an integer in [0, 20]", param="logprobs")
        sp = sampling_dict(body, body.max_tokens, body.logprobs is not None, body.logprobs or 0)
        if lora is not None:
            sp["lora_path"] = lora
        if body.echo and body.logprobs is not None:
            sp["logprob_start_len"] = 0  # echo with logprobs scores the prompt (max_tokens 0: only that)
        prompts = self.completion_inputs(body)
        jobs = []
        for ids in prompts:
            ids, params = validate_request(
                ids, sp, self.limits, default_max_new_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, max_param="max_tokens"
            )
            jobs.extend((ids, params) for _ in range(body.n))
        base = body.rid or body.request_id or f"cmpl-{uuid.uuid4().hex}"
        return await self._run(base, jobs, body, disconnected, chat=False)

    # -- chat ----------------------------------------------------------------------------------------------
    def chat_input(self, body: ChatRequest, tools: list[dict] | None = None) -> list[int]:
        if not body.messages:
            raise ValidationError("messages must not be empty", param="messages", code="empty_prompt")
        add_generation_prompt, kwargs = self._template_options(body)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError(no_template_message(), param="messages")
        msgs = []
        for m in body.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(text_parts(content))
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            for k in ("tool_calls", "tool_call_id", "name", "reasoning_content", "reasoning"):
                if getattr(m, k) is not None:
                    msg[k] = getattr(m, k)
            msgs.append(msg)
        msgs = render_messages(msgs, tools or [], self.tool_parser, self.template_has_tools)
        extra = {"tools": tools} if tools and self.template_has_tools else {}
        try:
            ids = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, return_dict=False, **extra, **kwargs
            )
        except Exception as e:  # a template error is the client's messages' fault
            raise ValidationError(f"cannot apply the chat template: {e}", param="messages") from None
        return list(ids)

    @staticmethod
    def _template_options(body) -> tuple[bool, dict[str, Any]]:
        """``add_generation_prompt`` and the rest of the template's arguments from ``body``:
        ``continue_final_message`` (vLLM: the last message is the assistant's, continued as is, with
        no generation prompt), ``documents``, ``reasoning_effort`` and ``chat_template_kwargs``."""
        kwargs: dict[str, Any] = dict(getattr(body, "chat_template_kwargs", None) or {})
        bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise ValidationError(
                f"chat_template_kwargs may not set {', '.join(bad)}", param=f"chat_template_kwargs.{bad[0]}"
            )
        agp = body.add_generation_prompt
        if body.continue_final_message:
            if agp:
                raise ValidationError(
                    "continue_final_message continues the last message, so it cannot be combined with "
                    "add_generation_prompt: true",
                    param="continue_final_message",
                )
            if body.messages[-1].role != "assistant":
                raise ValidationError(
                    "continue_final_message needs the last message to be the assistant's",
                    param="continue_final_message",
                )
            kwargs["continue_final_message"] = True
        effort = getattr(body, "reasoning_effort", None)
        if effort is not None:
            if effort not in REASONING_EFFORTS:
                raise ValidationError(
                    f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort"
                )
            # As SGLang: templates read one of these (Qwen3: enable_thinking; DeepSeek: thinking).
            kwargs.setdefault("reasoning_effort", effort)
            kwargs.setdefault("enable_thinking", effort != "none")
            kwargs.setdefault("thinking", effort != "none")
        if getattr(body, "documents", None) is not None:
            kwargs["documents"] = body.documents
        return (not body.continue_final_message) if agp is None else agp, kwargs

    def chat_job(self, body: ChatRequest, max_param: str | None = None) -> ChatJob:
        """One chat request's prompt ids, sampling params, tool and reasoning parsers: the chat path
        that ``/v1/chat/completions`` and ``/v1/responses`` share. ``max_param`` names the length
        field in errors (default: the chat field the body used)."""
        lora = self._check_common(body)
        top = body.top_logprobs or 0
        if body.top_logprobs is not None and not body.logprobs:
            raise ValidationError("top_logprobs needs logprobs: true", param="top_logprobs")
        if max_param is None:
            max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sp = sampling_dict(body, max_tokens, body.logprobs, top)
        if lora is not None:
            sp["lora_path"] = lora
        tools, forced = check_tools(body.tools, body.tool_choice)
        if forced is not None and any(k in sp for k in GRAMMAR_KINDS):
            raise ValidationError(
                "tool_choice required or a named function cannot be combined with another grammar",
                param="tool_choice",
            )
        if not any(k in sp for k in GRAMMAR_KINDS):  # auto beside a grammar of its own: that one decides
            calls = tool_call_grammar(self.tool_parser, tools, forced, body.parallel_tool_calls is not False)
            if calls is not None:
                sp["ebnf"] = calls
        reasoning = None
        if self.reasoning_format is not None:
            thinking = self.reasoning_format.thinking(self._template_options(body)[1])
            if thinking:  # the output begins with reasoning: a grammar starts after it (SGLang's rule)
                sp["require_reasoning"] = True
            if body.separate_reasoning:
                reasoning = ReasoningParser(self.reasoning_format, thinking, body.stream_reasoning)
        # Without max_tokens a chat answer may use all the context leaves (OpenAI, SGLang, vLLM).
        ids, params = validate_request(
            self.chat_input(body, tools=tools),
            sp,
            self.limits,
            default_max_new_tokens=None,
            max_param=max_param,
            prompt_name="messages",
        )
        return ChatJob(ids, params, self.tool_parser if tools else None, reasoning)

    async def chat(self, body: ChatRequest, disconnected) -> dict | AsyncIterator[str]:
        check_fanout(self.admission, 1, body.n, "messages")
        job = self.chat_job(body)
        base = body.rid or body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        return await self._run(
            base, [(job.ids, job.params)] * body.n, body, disconnected, chat=True, tools=job.tools,
            reasoning=job.reasoning,
        )  # fmt: skip

    # -- shared --------------------------------------------------------------------------------------------
    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)

    def _logprobs(self, st: GenState, chat: bool, start: int = 0, echo: bool = False) -> dict | None:
        if not (st.params.logprobs or st.params.top_logprobs):
            return None
        text = self.token_text
        ids, lps, tops = st.output_ids[start:], st.logprobs[start:], st.top_logprobs[start:]
        if echo and st.prompt is not None:  # the prompt's tokens first (the first has no logprob)
            plps, ptops = st.prompt.padded()
            ids, lps, tops = st.prompt.ids + ids, plps + lps, ptops + tops
        if chat:
            return {
                "content": [
                    {
                        "token": text(t),
                        "logprob": lp,
                        "bytes": list(text(t).encode()),
                        "top_logprobs": [
                            {"token": text(a), "logprob": b, "bytes": list(text(a).encode())}
                            for a, b in (top or [])
                        ],
                    }
                    for t, lp, top in zip(ids, lps, tops)
                ]
            }
        texts = [text(t) for t in ids]
        offsets, at = [], 0
        for piece in texts:
            offsets.append(at)
            at += len(piece)
        return {
            "tokens": texts,
            "token_logprobs": lps,
            "top_logprobs": [None if top is None else {text(a): b for a, b in top} for top in tops],
            "text_offset": offsets,
        }

    async def _run(
        self,
        base: str,
        jobs: list[tuple[list[int], SamplingParams]],
        body,
        disconnected,
        chat: bool,
        tools: ToolParser | None = None,
        reasoning: ReasoningParser | None = None,
    ):
        # PD: the router's bootstrap room(s), one per choice; validated before anything runs.
        rooms = parse_disagg(body.model_extra, len(jobs))
        echo = not chat and body.echo
        model = self.answer_model(body.model)
        created = int(time.time())
        rids = [f"{base}-{i}" for i in range(len(jobs))]
        if not body.stream:
            states = await self.gen.collect_all(
                [self.gen.collect(ids, p, rid, disagg=room) for (ids, p), rid, room in zip(jobs, rids, rooms)],
                disconnected,
            )
            for st in states:
                err = st.error()
                if err is not None:
                    raise err
            choices = []
            for i, st in enumerate(states):
                c: dict[str, Any] = {
                    "index": i,
                    "logprobs": self._logprobs(st, chat, echo=echo),
                    "finish_reason": finish_reason(st),
                    "matched_stop": matched_stop(st),
                }
                if chat:
                    # reasoning_content: null without reasoning, as SGLang and vLLM answer (their
                    # clients read it; the openai SDK raises for a field the answer lacks).
                    text, thought = st.visible, None
                    if reasoning is not None:
                        part = reasoning.split(text, final=True)
                        text, thought = part.content, part.reasoning or None
                    content, calls = split_calls(tools, text, st) if tools else (text, None)
                    c["message"] = {"role": "assistant", "content": content, "reasoning_content": thought}
                    if calls:
                        c["message"] = {
                            "role": "assistant",
                            "content": content or None,
                            "reasoning_content": thought,
                            "tool_calls": [call.to_openai() for call in calls],
                        }
                    c["finish_reason"] = tool_finish_reason(st, calls)
                else:
                    c["text"] = (self._echo_text(i, jobs[i][0], body) if echo else "") + st.visible
                choices.append(c)
            return {
                "id": base,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": self._usage(states, jobs, body.n),
            }
        opts = body.stream_options
        usage = (bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats), body.n)
        self.gen.check_room(len(jobs))  # all the choices, or none (429)
        queue, tasks = self._pump(jobs, rids, rooms)
        # Wait for each choice's first event: a request the engine refuses (a grammar that does not
        # compile, a full queue) is answered with its status code, not a 200 stream with an error.
        early: list = []
        seen: set[int] = set()
        while len(seen) < len(jobs):
            item = await queue.get()
            early.append(item)
            i, st, err = item
            if i in seen:
                continue
            seen.add(i)
            refused = err if err is not None else (st.error() if not st.output_ids else None)
            if refused is not None:
                for t in tasks:
                    t.cancel()
                raise refused
        echo_texts = [self._echo_text(j, ids, body) for j, (ids, _) in enumerate(jobs)] if echo else None
        return self._stream(base, jobs, model, created, chat, usage, queue, tasks, early, tools, echo_texts, reasoning)

    def _pump(self, jobs, rids, rooms) -> tuple[asyncio.Queue, list[asyncio.Task]]:
        """One task per choice, putting ``(choice, state, error)`` on one queue; a final
        ``StopAsyncIteration`` marks each choice's end."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids, params, rid, room):
            try:
                async for st in self.gen.stream(ids, params, rid, disagg=room):
                    await queue.put((i, st, None))
            except Exception as e:
                await queue.put((i, None, e))
            finally:
                await queue.put((i, None, StopAsyncIteration()))

        tasks = [
            asyncio.create_task(pump(i, ids, p, rid, room))
            for i, ((ids, p), rid, room) in enumerate(zip(jobs, rids, rooms))
        ]
        return queue, tasks

    def _echo_text(self, j: int, ids: list[int], body) -> str:
        """The prompt of choice ``j`` as the client sent it (choices are n per prompt, in order)."""
        text, _ = split_openai_prompt(body.prompt)
        if isinstance(text, str):
            return text
        if isinstance(text, list):
            return text[j // body.n]
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    @staticmethod
    def _usage(states: list[GenState | None], jobs, n: int) -> dict:
        """Usage of a request's choices (``n`` per prompt, in order; None: a choice that failed). A
        prompt and its cached tokens count once, from its first choice, whatever ``n`` (SGLang's rule)."""
        firsts = range(0, len(jobs), n)
        p = sum(len(jobs[i][0]) for i in firsts)
        c = sum(len(s.output_ids) for s in states if s is not None)
        cached = sum(states[i].cached_tokens for i in firsts if states[i] is not None)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _stream(
        self, base, jobs, model, created, chat, usage, queue, tasks, early, tools=None, echo=None, reasoning=None
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage, continuous_usage, n = usage

        def chunk(
            i: int, delta_text: str | None, st: GenState | None, fr=None, lp=None, role=False, calls=None,
            thought: str | None = None,
        ) -> dict:  # fmt: skip
            c: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": fr}
            c["matched_stop"] = matched_stop(st) if fr is not None and st is not None else None
            if chat:
                delta: dict[str, Any] = {"reasoning_content": thought}  # as in the message (SGLang's deltas)
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                if calls is not None:
                    delta["tool_calls"] = calls
                c["delta"] = delta
            else:
                c["text"] = delta_text or ""
            out = {"id": base, "object": obj, "created": created, "model": model, "choices": [c]}
            if continuous_usage:  # vLLM's and SGLang's: this choice's usage so far, in every chunk
                p, k = len(jobs[i][0]), len(st.output_ids) if st is not None else 0
                out["usage"] = {"prompt_tokens": p, "completion_tokens": k, "total_tokens": p + k}
            return out

        shown = [0] * len(jobs)
        thought_shown = [0] * len(jobs)
        calls_sent = [0] * len(jobs)
        tok_shown = [0] * len(jobs)
        final: list[GenState | None] = [None] * len(jobs)
        live = len(jobs)
        try:
            if chat:
                for i in range(len(jobs)):
                    yield sse(chunk(i, "", None, role=True))
            echoed = [echo is None] * len(jobs)
            while live:
                # An item says that choice i changed. Its state is the live one, which its pump may
                # have advanced further before this loop got here, so one item may find several
                # steps' tokens and a later item of the same choice nothing new (skipped below).
                i, st, err = early.pop(0) if early else await queue.get()
                if isinstance(err, StopAsyncIteration):
                    live -= 1
                    continue
                if err is not None:
                    yield sse(error_body(str(err), getattr(err, "type", "internal_error")))
                    continue
                if final[i] is not None:
                    continue  # the choice has ended: a late item
                e = st.error()
                if e is not None and not st.output_ids:
                    yield sse(e.to_dict())
                    final[i] = st
                    continue
                if not echoed[i] and not (st.output_ids or st.finished):
                    continue  # the echo waits until the whole prompt is scored
                text, new_thought = st.visible, ""
                if reasoning is not None:
                    part = reasoning.split(text, st.finished)
                    text = part.content
                    if reasoning.stream or part.closed or st.finished:  # stream_reasoning false: whole, once
                        new_thought = (part.reasoning or "")[thought_shown[i] :]
                        thought_shown[i] += len(new_thought)
                text, calls = split_calls(tools, text, st) if tools else (text, None)
                new_text = text[shown[i] :]
                shown[i] = max(shown[i], len(text))
                new_tokens = len(st.output_ids) - tok_shown[i]
                lp = self._logprobs(st, chat, tok_shown[i], echo=not echoed[i])
                if new_thought:  # the reasoning first (with this step's logprobs), then the answer's text
                    yield sse(chunk(i, None, st, lp=lp, thought=new_thought))
                    lp = None
                if not echoed[i]:  # the first chunk of an echoed completion begins with the prompt
                    new_text, echoed[i] = echo[i] + new_text, True
                tok_shown[i] = len(st.output_ids)
                fr = finish_reason(st)
                for j, call in enumerate((calls or [])[calls_sent[i] :], start=calls_sent[i]):
                    # As OpenAI streams a call: its id and name first, then the arguments.
                    d = call.to_openai(index=j)
                    args, d["function"] = d["function"]["arguments"], {"name": call.name, "arguments": ""}
                    yield sse(chunk(i, None, st, calls=[d]))
                    yield sse(chunk(i, None, st, calls=[{"index": j, "function": {"arguments": args}}]))
                    calls_sent[i] = j + 1
                if calls_sent[i]:
                    fr = tool_finish_reason(st, True)
                # A chunk before the last carries text or, with logprobs, the tokens whose text is
                # still held back (an incomplete character, a possible stop string or tool call).
                if new_text or (lp is not None and new_tokens) or st.finished:
                    yield sse(chunk(i, new_text, st, fr, lp))
                if st.finished:
                    final[i] = st
            if include_usage:
                yield sse(
                    {
                        "id": base,
                        "object": obj,
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": self._usage(final, jobs, n),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
