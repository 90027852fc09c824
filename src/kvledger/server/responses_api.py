"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: a Responses request becomes a chat request
(``responses_input.py`` converts), runs on the chat path (``OpenAIServing.chat_job``: template, tools'
grammar, structured output, one validation) and is answered as a response object or its event stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from ..errors import KVLedgerError, ValidationError
from .auth import current_principal
from .generation import GenState
from .openai_api import ChatJob, OpenAIServing
from .openai_format import split_calls
from .protocol import ChatRequest, ResponsesRequest
from .responses import OutputBuilder, new_id, now, usage
from .responses_input import (
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
    output_messages,
)
from .responses_store import ResponseStore, Stored

STATUS = {"stop": "completed", "length": "incomplete", "abort": "failed"}  # by finish type
ITEM_STATUS = {"completed": "completed", "incomplete": "incomplete", "failed": "incomplete"}  # its items


def responses_param(param: str | None) -> str | None:
    """A chat field's name in an error as the Responses request spells it."""
    if param is None:
        return None
    if param.startswith("tools.") and ".function." in param:  # tools are flat here
        return param.replace(".function.", ".", 1)
    if param.startswith("response_format.json_schema."):
        return "text.format." + param.removeprefix("response_format.json_schema.")
    return {"messages": "input", "input_ids": "input", "response_format": "text.format",
            "json_schema": "text.format.schema"}.get(param, param)  # fmt: skip


def sse_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def _parts(job: ChatJob, st: GenState) -> dict[str, Any]:
    """A completion so far as the output builder takes it: reasoning (split off where the server has
    a reasoning parser), then the answer's text and tool calls."""
    text, thought, done = st.visible, None, False
    if job.reasoning is not None:
        part = job.reasoning.split(text, st.finished)
        text, thought, done = part.content, part.reasoning, part.closed
    text, calls = split_calls(job.tools, text, st) if job.tools else (text, None)
    return {"text": text, "calls": calls, "thought": thought, "thought_done": done}


class ResponsesServing:
    """Creates responses on ``chat``'s path and keeps the stored ones in ``store``."""

    def __init__(self, chat: OpenAIServing, store: ResponseStore):
        self.chat = chat
        self.store = store

    def retrieve(self, rid: str) -> dict[str, Any]:
        return self.store.get(rid, current_principal().owner, param="response_id").response

    def delete(self, rid: str) -> dict[str, Any]:
        self.store.delete(rid, current_principal().owner)
        return {"id": rid, "object": "response", "deleted": True}

    async def _job(self, body: ResponsesRequest) -> tuple[list[dict], ChatJob]:
        """The conversation so far (without instructions) and the chat job (prompt ids, sampling
        params, tool and reasoning parsers; remote image URLs fetched first)."""
        if body.max_output_tokens is not None and body.max_output_tokens < 1:  # no prompt scoring here
            raise ValidationError("max_output_tokens must be at least 1", param="max_output_tokens")
        prev = body.previous_response_id
        conversation = list(self.store.get(prev, current_principal().owner).conversation) if prev is not None else []
        conversation += input_messages(body.input, reasoning=self.chat.reasoning_format is not None)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            chat = ChatRequest.model_validate({
                "model": body.model, "messages": system + conversation, "max_completion_tokens": body.max_output_tokens,
                "temperature": body.temperature, "top_p": body.top_p, "tools": chat_tools(body.tools),
                "tool_choice": chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
                "response_format": chat_response_format(body.text), "priority": body.priority,
                "cache_salt": body.cache_salt, "extra_key": body.extra_key,
            })  # fmt: skip
        except PydanticValidationError as e:  # a converted value of the wrong type: the client's input
            raise ValidationError(f"input: {e.errors()[0]['msg']}", param="input") from None
        return conversation, await self.chat.prepared_chat_job(chat, max_param="max_output_tokens")

    def _response(self, body: ResponsesRequest, rid: str, created: int, status: str, output, use) -> dict:
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.chat.answer_model(body.model), "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature,
            "top_p": body.top_p, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": {"format": fmt}, "store": body.store, "truncation": "disabled", "metadata": {}, "usage": use,
        }  # fmt: skip

    def _finish(self, body, rid, created, conversation, ids, st: GenState, out: OutputBuilder) -> dict:
        status = STATUS.get(st.finish.type, "completed")
        resp = self._response(body, rid, created, status, out.items, usage(len(ids), st.cached_tokens, len(st.output_ids)))
        if status == "failed":  # aborted (by /abort_request, a shutdown): what it wrote, and why it ended
            resp["error"] = {"code": "request_aborted", "message": st.finish.message or "the request was aborted"}
        if body.store:
            self.store.put(rid, Stored(resp, conversation + output_messages(out.items), current_principal().owner))
        return resp

    async def create(self, body: ResponsesRequest, disconnected) -> dict | AsyncIterator[str]:
        try:
            return await self._create(body, disconnected)
        except KVLedgerError as e:  # the chat path's or the engine's refusal, naming this request's field
            e.param = responses_param(e.param)
            raise

    async def _create(self, body: ResponsesRequest, disconnected) -> dict | AsyncIterator[str]:
        self.chat.check_model(body.model, adapters=True)
        conversation, job = await self._job(body)
        ids = job.ids
        rid = new_id("resp")
        created = now()
        if not body.stream:
            st = await self.chat.gen.collect(ids, job.params, rid, disconnected=disconnected, images=job.images)
            err = st.error()
            if err is not None:
                raise err
            out = OutputBuilder()
            out.update(**_parts(job, st), final=True, status=ITEM_STATUS[STATUS.get(st.finish.type, "completed")])
            return self._finish(body, rid, created, conversation, ids, st, out)
        states = self.chat.gen.stream(ids, job.params, rid, images=job.images)
        try:
            first = await anext(states)  # a request the engine refuses is answered with its status
        except BaseException:
            await states.aclose()
            raise
        err = first.error()
        if err is not None and not first.output_ids:
            await states.aclose()
            raise err
        return self._events(body, rid, created, conversation, job, first, states)

    async def _events(self, body, rid, created, conversation, job, first, states) -> AsyncIterator[str]:
        seq = 0

        def ev(event: dict) -> str:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            return sse_event(event)

        out = OutputBuilder()
        try:
            start = self._response(body, rid, created, "in_progress", [], None)
            yield ev({"type": "response.created", "response": start})
            yield ev({"type": "response.in_progress", "response": start})
            st = first
            while True:
                e = st.error()
                if e is not None:  # ended by the engine after it began (aborted, shutting down)
                    err = e.to_dict()["error"]
                    yield ev({"type": "error", "code": err["code"], "message": err["message"], "param": err["param"]})
                    failed = self._response(body, rid, created, "failed", out.items, None)
                    failed["error"] = {"code": err["code"] or err["type"], "message": err["message"]}
                    yield ev({"type": "response.failed", "response": failed})
                    return
                status = ITEM_STATUS[STATUS.get(st.finish.type, "completed")] if st.finished else "completed"
                for event in out.update(**_parts(job, st), final=st.finished, status=status):
                    yield ev(event)
                if st.finished:
                    break
                st = await anext(states)
            resp = self._finish(body, rid, created, conversation, job.ids, st, out)
            if resp["error"] is not None:
                yield ev({"type": "error", "param": None, **resp["error"]})
            yield ev({"type": f"response.{resp['status']}", "response": resp})
        finally:
            await states.aclose()
