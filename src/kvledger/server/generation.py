"""Front-side life of one request: submit to the engine, gather tokens, detokenize, time it, and
abort it through the engine's release path if the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.detok import TextState
from ..errors import KVLedgerError
from ..scheduler import SamplingParams
from .engine_client import EngineClient
from .metrics import Metrics


class RequestFailed(KVLedgerError):
    """The engine ended a request with an error status (4xx/5xx) before any output."""

    def __init__(self, message: str, status: int, code: str | None = None, param: str | None = None):
        super().__init__(message, code=code, param=param)
        self.status = status
        self.type = {
            400: "invalid_request_error",
            404: "not_found_error",
            409: "conflict_error",
            429: "overloaded_error",
            503: "service_unavailable",
        }.get(status, "internal_error")


@dataclass
class GenState:
    rid: str
    params: SamplingParams
    text: TextState
    prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish: dict | None = None
    visible: str = ""

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def finish_for_meta(self) -> dict | None:
        if self.finish is None:
            return None
        d = {"type": self.finish["type"]}
        if self.finish.get("matched") is not None:
            d["matched"] = self.finish["matched"]
        if self.finish.get("message"):
            d["message"] = self.finish["message"]
        return d

    def error(self) -> RequestFailed | None:
        f = self.finish
        if f is None or f.get("status", 200) < 400:
            return None
        return RequestFailed(f.get("message") or "request failed", f["status"], f.get("code"), f.get("param"))


class Generator:
    """Runs requests against the engine for the HTTP handlers."""

    def __init__(self, client: EngineClient, tokenizer, metrics: Metrics):
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._bg: set[asyncio.Task] = set()

    def _abort_soon(self, rid: str, message: str) -> None:
        # Called from a finally block of a cancelled task: schedule, do not await.
        t = asyncio.get_running_loop().create_task(self.client.abort(rid, message))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def stream(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        health: bool = False,
        session_params: dict | None = None,
    ) -> AsyncIterator[GenState]:
        """Yield the request's state after each batch of new tokens; the last one is finished."""
        import dataclasses

        rid = rid or uuid.uuid4().hex
        st = GenState(
            rid,
            params,
            TextState(self.tokenizer, params.skip_special_tokens, params.stop),
            prompt_tokens=len(input_ids),
        )
        t0 = time.monotonic()
        last = None
        q = await self.client.submit(rid, input_ids, dataclasses.asdict(params), health, session_params)
        try:
            while True:
                item = await q.get()
                items = [item]
                while not q.empty() and not items[-1]["finished"]:
                    items.append(q.get_nowait())
                now = time.monotonic()
                for it in items:
                    if it["new_ids"]:
                        if last is None:
                            self.metrics.ttft.observe(now - t0)
                        else:
                            self.metrics.itl.observe(now - last)
                        last = now
                    st.output_ids.extend(it["new_ids"])
                    st.logprobs.extend(it["new_logprobs"])
                    st.top_logprobs.extend(it["new_top_logprobs"])
                    st.cached_tokens = it["cached_tokens"] or st.cached_tokens
                    st.completion_tokens = it["completion_tokens"] or len(st.output_ids)
                    if it["finished"]:
                        st.finish = it["finish_reason"]
                if st.finish is not None:
                    self._account(st, now - t0)
                st.visible = self._text(st)
                yield st
                if st.finish is not None:
                    return
        finally:
            if st.finish is None:
                # The consumer went away (client disconnect, cancelled handler): abort in the engine,
                # which releases the request through its one release path.
                self.client.streams.pop(rid, None)
                self._abort_soon(rid, "the client disconnected")
                self.metrics.aborted.labels("client_disconnect").inc()

    def _text(self, st: GenState) -> str:
        from ..scheduler.request import FinishReason

        fr = None
        if st.finish is not None:
            fr = FinishReason(st.finish["type"], matched=st.finish.get("matched"))
        return st.text.update(st.output_ids, fr)

    def _account(self, st: GenState, e2e: float) -> None:
        m = self.metrics
        m.e2e.observe(e2e)
        m.prompt_tokens.inc(st.prompt_tokens)
        m.generation_tokens.inc(len(st.output_ids))
        m.cache_hit.inc(st.cached_tokens)
        m.requests.labels(st.finish["type"]).inc()
        if st.finish["type"] == "abort":
            status = st.finish.get("status", 200)
            reason = {400: "validation", 409: "conflict", 429: "queue_full", 503: "engine_unavailable"}.get(
                status, "engine_error" if status >= 500 else "abort"
            )
            m.aborted.labels(reason).inc()

    async def collect(
        self, input_ids, params, rid=None, health=False, disconnected=None, session_params=None
    ) -> GenState:
        """Run to completion. ``disconnected`` is polled; if it turns true the request is aborted."""
        final: GenState | None = None

        async def run() -> GenState:
            last = None
            async for state in self.stream(input_ids, params, rid, health, session_params):
                last = state
            return last

        task = asyncio.create_task(run())
        if disconnected is None:
            final = await task
        else:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    final = task.result()
                    break
                if await disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    raise asyncio.CancelledError
        return final
