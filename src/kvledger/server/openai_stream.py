"""A streamed OpenAI answer: one task per choice feeding one queue (``pump``), each choice's first
event awaited before the answer starts (``first_events``: a refusal is answered with its status, not
a 200 stream), then the SSE stream (``StreamWriter``): every choice's new text, reasoning, tool calls
and logprobs, each choice ended once, the usage, ``[DONE]``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator

from ..errors import error_body
from .generation import GenerationService, GenState
from .openai_format import Chunks, finish_reason, logprobs, split_calls, sse, tool_finish_reason, usage
from .reasoning import ReasoningParser
from .tools import ToolCall, ToolParser


def pump(gen: GenerationService, jobs, rids, rooms, images=None) -> tuple[asyncio.Queue, list[asyncio.Task]]:
    """One task per choice, putting ``(choice, state, error)`` on one queue; a final
    ``StopAsyncIteration`` marks each choice's end. ``images``: every choice's (one prompt's)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def one(i: int, ids, params, rid, room):
        try:
            async for st in gen.stream(ids, params, rid, disagg=room, images=images):
                await queue.put((i, st, None))
        except Exception as e:
            await queue.put((i, None, e))
        finally:
            await queue.put((i, None, StopAsyncIteration()))

    tasks = [
        asyncio.create_task(one(i, ids, p, rid, room))
        for i, ((ids, p), rid, room) in enumerate(zip(jobs, rids, rooms))
    ]
    return queue, tasks


async def first_events(queue: asyncio.Queue, tasks: list[asyncio.Task], count: int) -> list:
    """Wait for each of ``count`` choices' first event: a request the engine refuses (a grammar that
    does not compile, a full queue) is raised (every choice cancelled), to be answered with its
    status code, not a 200 stream with an error. Returns the events taken, for the stream to replay."""
    early: list = []
    seen: set[int] = set()
    while len(seen) < count:
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
    return early


class StreamWriter:
    """The SSE events of one streamed answer, from the queue its choices' tasks feed (after the
    ``early`` events already taken). Per choice it remembers what was sent (text, reasoning, tool
    calls, tokens), so each piece is sent once and each choice ends once."""

    def __init__(
        self,
        chunks: Chunks,
        jobs: list,
        token_text: Callable[[int], str],
        queue: asyncio.Queue,
        tasks: list[asyncio.Task],
        early: list,
        include_usage: bool,
        n: int,
        tools: ToolParser | None = None,
        echo: list[str] | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.chunks, self.jobs, self.token_text = chunks, jobs, token_text
        self.queue, self.tasks, self.early = queue, tasks, early
        self.include_usage, self.n = include_usage, n
        self.tools, self.echo, self.reasoning = tools, echo, reasoning
        k = len(jobs)
        self.shown = [0] * k  # characters of content sent
        self.thought_shown = [0] * k  # characters of reasoning sent
        self.calls_sent = [0] * k
        self.tok_shown = [0] * k  # tokens whose logprobs were sent
        self.echoed = [echo is None] * k  # the prompt sent (or none to send)
        self.final: list[GenState | None] = [None] * k

    async def events(self) -> AsyncIterator[str]:
        """The stream: a chat's role chunks, each choice's chunks as its state changes, the usage
        (``include_usage``), ``[DONE]``; the choices' tasks are cancelled however it ends."""
        chunk = self.chunks.chunk
        live = len(self.jobs)
        try:
            if self.chunks.chat:
                for i in range(len(self.jobs)):
                    yield sse(chunk(i, "", None, role=True))
            while live:
                # An item says that choice i changed. Its state is the live one, which its pump may
                # have advanced further before this loop got here, so one item may find several
                # steps' tokens and a later item of the same choice nothing new (skipped below).
                i, st, err = self.early.pop(0) if self.early else await self.queue.get()
                if isinstance(err, StopAsyncIteration):
                    live -= 1
                    continue
                for line in self._on_item(i, st, err):
                    yield line
            if self.include_usage:
                yield sse(self.chunks.usage_chunk(usage(self.final, self.jobs, self.n)))
            yield "data: [DONE]\n\n"
        finally:
            for t in self.tasks:
                t.cancel()

    def _on_item(self, i: int, st: GenState | None, err: Exception | None) -> Iterator[str]:
        """The events for choice ``i``'s item: an error, or what its state has that was not sent."""
        if err is not None:
            yield sse(error_body(str(err), getattr(err, "type", "internal_error")))
            return
        if self.final[i] is not None:
            return  # the choice has ended: a late item
        e = st.error()
        if e is not None and not st.output_ids:
            yield sse(e.to_dict())
            self.final[i] = st
            return
        if not self.echoed[i] and not (st.output_ids or st.finished):
            return  # the echo waits until the whole prompt is scored
        yield from self._progress(i, st)

    def _progress(self, i: int, st: GenState) -> Iterator[str]:
        """Choice ``i``'s new reasoning, tool calls and text (with their logprobs), and its end."""
        chunk = self.chunks.chunk
        text, new_thought = self._split_reasoning(i, st)
        text, calls = split_calls(self.tools, text, st) if self.tools else (text, None)
        new_text = text[self.shown[i] :]
        self.shown[i] = max(self.shown[i], len(text))
        new_tokens = len(st.output_ids) - self.tok_shown[i]
        lp = logprobs(st, self.chunks.chat, self.token_text, self.tok_shown[i], echo=not self.echoed[i])
        if new_thought:  # the reasoning first (with this step's logprobs), then the answer's text
            yield sse(chunk(i, None, st, lp=lp, thought=new_thought))
            lp = None
        if not self.echoed[i]:  # the first chunk of an echoed completion begins with the prompt
            new_text, self.echoed[i] = self.echo[i] + new_text, True
        self.tok_shown[i] = len(st.output_ids)
        fr = finish_reason(st)
        yield from self._tool_calls(i, st, calls)
        if self.calls_sent[i]:
            fr = tool_finish_reason(st, True)
        # A chunk before the last carries text or, with logprobs, the tokens whose text is
        # still held back (an incomplete character, a possible stop string or tool call).
        if new_text or (lp is not None and new_tokens) or st.finished:
            yield sse(chunk(i, new_text, st, fr, lp))
        if st.finished:
            self.final[i] = st

    def _split_reasoning(self, i: int, st: GenState) -> tuple[str, str]:
        """Choice ``i``'s content so far and its reasoning not sent yet ("" without a parser)."""
        text, new_thought = st.visible, ""
        if self.reasoning is not None:
            part = self.reasoning.split(text, st.finished)
            text = part.content
            if self.reasoning.stream or part.closed or st.finished:  # stream_reasoning false: whole, once
                new_thought = (part.reasoning or "")[self.thought_shown[i] :]
                self.thought_shown[i] += len(new_thought)
        return text, new_thought

    def _tool_calls(self, i: int, st: GenState, calls: list[ToolCall] | None) -> Iterator[str]:
        """Choice ``i``'s complete tool calls not sent yet, each as OpenAI streams a call: its id and
        name first, then the arguments."""
        for j, call in enumerate((calls or [])[self.calls_sent[i] :], start=self.calls_sent[i]):
            d = call.to_openai(index=j)
            args, d["function"] = d["function"]["arguments"], {"name": call.name, "arguments": ""}
            yield sse(self.chunks.chunk(i, None, st, calls=[d]))
            yield sse(self.chunks.chunk(i, None, st, calls=[{"index": j, "function": {"arguments": args}}]))
            self.calls_sent[i] = j + 1
