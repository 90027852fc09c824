"""OpenAI-compatible /v1/completions and /v1/chat/completions on top of ``GenerationService``: the
checks of a body, its prompts (``chat_input``: the chat template), its jobs (``chat_job`` is shared
with ``/v1/responses``), and the answer, whole or streamed. The body's fields are read in
``openai_params.py``, the answer's shape is ``openai_format.py``'s, the stream ``openai_stream.py``'s."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..common import SamplingParams, parse_prompts, validate_request
from ..common.disagg import parse_disagg
from ..common.messages import WireImage
from ..common.prompts import split_openai_prompt
from ..common.reasoning import REASONING_FORMATS
from ..common.sampling import GRAMMAR_KINDS
from ..errors import NotFoundError, ValidationError
from ..model.chat_templates import no_template_message
from ..multimodal.inputs import to_wire
from ..multimodal.media import MediaLimits
from ..multimodal.processor import ImageProcessing
from ..multimodal.remote import RemoteFetcher
from .admission import AdmissionLimits, check_fanout, check_prompt_tokens, prompt_count
from .generation import GenerationService
from .image_parts import ChatImages, ImageReader, chat_image_parts, content_text, remote_chat_urls
from .openai_format import Chunks, chat_message, finish_reason, logprobs, matched_stop, usage
from .openai_params import COMPLETIONS_DEFAULT_MAX_TOKENS, sampling_dict, template_options
from .openai_stream import StreamWriter, first_events, pump
from .protocol import ChatRequest, CompletionRequest, _OpenAICommon
from .reasoning import ReasoningParser
from .tool_grammar import tool_call_grammar
from .tool_requests import check_tools, render_messages
from .tools import ToolParser, make_parser


@dataclass
class ChatJob:
    """One chat request, ready to run: what ``/v1/chat/completions`` and ``/v1/responses`` share."""

    ids: list[int]
    params: SamplingParams
    tools: ToolParser | None  # None without tools
    reasoning: ReasoningParser | None  # None without a reasoning parser, or with separate_reasoning false
    images: list[WireImage] | None = None  # its images (their placeholder runs are in ``ids``)


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
        images: ImageProcessing | None = None,
        media: MediaLimits | None = None,
        max_images: int = 8,
    ):
        """``images``: a vision-language model's processor (None: a text-only model, which refuses
        image parts); ``media`` the limits image parts are read within, ``max_images`` per request."""
        self.gen = gen
        self.images = images
        self.media = media or MediaLimits()
        self.max_images = max_images
        self.remote = RemoteFetcher(self.media)
        # Image parts are read, decoded and processed in a bounded thread pool, off the event loop.
        self.reader = ImageReader(images, self.media) if images is not None else None
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
    def chat_input(
        self, body: ChatRequest, tools: list[dict] | None = None, images: ChatImages | None = None
    ) -> list[int]:
        """The chat template's prompt ids; image parts (decoded into ``images``) as placeholders."""
        images = images if images is not None else ChatImages()
        if not body.messages:
            raise ValidationError("messages must not be empty", param="messages", code="empty_prompt")
        add_generation_prompt, kwargs = template_options(body)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError(no_template_message(), param="messages")
        msgs = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                content = content_text(
                    content, f"messages[{i}].content", self.images, self.media, self.max_images, images
                )
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

    async def remote_images(self, body: ChatRequest) -> dict[str, bytes]:
        """The bodies of a chat request's remote image URLs, fetched before ``chat_job`` reads its
        parts (asynchronously: the front serves on meanwhile). Nothing is fetched when the server
        takes no images or no remote URLs: ``chat_job`` refuses those parts then."""
        if self.images is None or not self.media.allow_remote_media:
            return {}
        return await self.remote.fetch_all(remote_chat_urls(body.messages, self.max_images))

    async def read_images(self, body: ChatRequest, fetched: dict[str, bytes]) -> dict:
        """A chat request's image parts read, decoded and processed in the reader's thread pool (the
        loop serves on meanwhile), by part name, for ``chat_job``; a bad part's 400 is raised here,
        before anything is sent to the engine. Nothing is read for a text-only model."""
        if self.reader is None:
            return {}
        return await self.reader.read_all(chat_image_parts(body.messages, self.max_images), fetched)

    async def prepared_chat_job(self, body: ChatRequest, max_param: str | None = None) -> ChatJob:
        """``chat_job`` after its remote images are fetched and its image parts read off the loop."""
        fetched = await self.remote_images(body)
        prepared = await self.read_images(body, fetched)
        return self.chat_job(body, max_param, fetched, prepared)

    def close(self) -> None:
        """The front ends: the image reader's threads go."""
        if self.reader is not None:
            self.reader.close()

    def chat_job(
        self, body: ChatRequest, max_param: str | None = None, fetched: dict[str, bytes] | None = None,
        prepared: dict | None = None,
    ) -> ChatJob:  # fmt: skip
        """One chat request's prompt ids, sampling params, tool and reasoning parsers: the chat path
        that ``/v1/chat/completions`` and ``/v1/responses`` share. ``max_param`` names the length
        field in errors (default: the chat field the body used); ``fetched`` holds the bodies of its
        remote image URLs (``remote_images``), ``prepared`` its image parts already read
        (``read_images``; a part not there is read here, on the caller's thread)."""
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
            thinking = self.reasoning_format.thinking(template_options(body)[1])
            if thinking:  # the output begins with reasoning: a grammar starts after it (SGLang's rule)
                sp["require_reasoning"] = True
            if body.separate_reasoning:
                reasoning = ReasoningParser(self.reasoning_format, thinking, body.stream_reasoning)
        # Without max_tokens a chat answer may use all the context leaves (OpenAI, SGLang, vLLM).
        ids, mm = self.chat_prompt(body, tools, fetched, prepared)
        ids, params = validate_request(
            ids,
            sp,
            self.limits,
            default_max_new_tokens=None,
            max_param=max_param,
            prompt_name="messages",
        )
        return ChatJob(ids, params, self.tool_parser if tools else None, reasoning, to_wire(mm) if mm else None)

    def chat_prompt(
        self, body: ChatRequest, tools=None, fetched: dict[str, bytes] | None = None, prepared: dict | None = None
    ) -> tuple[list[int], Any]:
        """The messages through the chat template as token ids, each image's placeholder repeated for its
        image (before the length is checked), and the images' ``MultimodalInputs`` (None: no image)."""
        images = ChatImages(fetched=fetched or {}, prepared=prepared or {})
        ids = self.chat_input(body, tools=tools, images=images)
        if not images.images:
            return ids, None
        return self.images.expand(ids, images.images, images.params)

    async def chat(self, body: ChatRequest, disconnected) -> dict | AsyncIterator[str]:
        check_fanout(self.admission, 1, body.n, "messages")
        job = await self.prepared_chat_job(body)
        base = body.rid or body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        return await self._run(
            base, [(job.ids, job.params)] * body.n, body, disconnected, chat=True, tools=job.tools,
            reasoning=job.reasoning, images=job.images,
        )  # fmt: skip

    # -- shared --------------------------------------------------------------------------------------------
    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)

    async def _run(
        self,
        base: str,
        jobs: list[tuple[list[int], SamplingParams]],
        body,
        disconnected,
        chat: bool,
        tools: ToolParser | None = None,
        reasoning: ReasoningParser | None = None,
        images: list[WireImage] | None = None,
    ):
        """Run a request's choices (``jobs``, one per choice) and answer: one whole answer, or a stream.
        ``images``: the prompt's (every choice has the same prompt)."""
        # PD: the router's bootstrap room(s), one per choice; validated before anything runs.
        rooms = parse_disagg(body.model_extra, len(jobs))
        model = self.answer_model(body.model)
        created = int(time.time())
        rids = [f"{base}-{i}" for i in range(len(jobs))]
        if not body.stream:
            states = await self.gen.collect_all(
                [
                    self.gen.collect(ids, p, rid, disagg=room, images=images)
                    for (ids, p), rid, room in zip(jobs, rids, rooms)
                ],
                disconnected,
            )
            for st in states:
                err = st.error()
                if err is not None:
                    raise err
            return {
                "id": base,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [self._choice(i, st, jobs, body, chat, tools, reasoning) for i, st in enumerate(states)],
                "usage": usage(states, jobs, body.n),
            }
        opts = body.stream_options
        self.gen.check_room(len(jobs))  # all the choices, or none (429)
        queue, tasks = pump(self.gen, jobs, rids, rooms, images)
        early = await first_events(queue, tasks, len(jobs))
        echo = not chat and body.echo
        echo_texts = [self._echo_text(j, ids, body) for j, (ids, _) in enumerate(jobs)] if echo else None
        prompt_lens = [len(ids) for ids, _ in jobs]
        chunks = Chunks(base, chat, created, model, prompt_lens, bool(opts and opts.continuous_usage_stats))
        writer = StreamWriter(
            chunks, jobs, self.token_text, queue, tasks, early, bool(opts and opts.include_usage), body.n,
            tools, echo_texts, reasoning,
        )  # fmt: skip
        return writer.events()

    def _choice(self, i: int, st, jobs, body, chat: bool, tools, reasoning) -> dict[str, Any]:
        """Choice ``i`` of a whole answer: a chat message, or a completion's text (after the prompt
        with ``echo``)."""
        echo = not chat and body.echo
        c: dict[str, Any] = {
            "index": i,
            "logprobs": logprobs(st, chat, self.token_text, echo=echo),
            "finish_reason": finish_reason(st),
            "matched_stop": matched_stop(st),
        }
        if chat:
            c["message"], c["finish_reason"] = chat_message(st, tools, reasoning)
        else:
            c["text"] = (self._echo_text(i, jobs[i][0], body) if echo else "") + st.visible
        return c

    def _echo_text(self, j: int, ids: list[int], body) -> str:
        """The prompt of choice ``j`` as the client sent it (choices are n per prompt, in order)."""
        text, _ = split_openai_prompt(body.prompt)
        if isinstance(text, str):
            return text
        if isinstance(text, list):
            return text[j // body.n]
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
