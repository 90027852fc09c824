"""Front-side life of one request: submit to the engine, gather tokens, detokenize, time it, and
abort it through the engine's release path if the client goes away."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..common import FinishReason, RequestOutput, SamplingParams, meta_info
from ..common.disagg import DisaggParams
from ..common.messages import WireImage
from ..common.outputs import PromptLogprobs, TopLogprobs
from ..common.pooling import PoolingParams
from ..engine.detok import TextState
from ..errors import KVLedgerError, OverloadedError
from .admission import InFlight
from .auth import current_principal
from .control import GenerationGate
from .engine_client import EngineClient
from .metrics import Metrics
from .session_store import SessionStore

ABORT_REASONS = {400: "validation", 409: "conflict", 429: "queue_full", 503: "engine_unavailable"}


@dataclass
class GenState:
    """What the front knows of one request so far."""

    rid: str
    params: SamplingParams
    text: TextState
    prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    cached_tokens: int = 0
    spec_verify_ct: int = 0
    finish: FinishReason | None = None
    visible: str = ""
    prompt: PromptLogprobs | None = None  # scoring: the prompt's logprobs as they arrive
    embedding: list[float] | None = None  # a pooling request's answer (common/pooling.py)
    label_logprobs: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def error(self) -> KVLedgerError | None:
        return None if self.finish is None else self.finish.to_error()

    def add(self, out: RequestOutput) -> int:
        """Take one engine output; returns the tokens a verify step gave (0 if none was verified)."""
        verified = len(out.new_ids) if out.spec_verify_ct > self.spec_verify_ct else 0
        self.spec_verify_ct = max(self.spec_verify_ct, out.spec_verify_ct)
        self.output_ids.extend(out.new_ids)
        self.logprobs.extend(out.new_logprobs)
        self.top_logprobs.extend(out.new_top_logprobs)
        if self.prompt is not None:
            self.prompt.add(out)
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        # The engine's count: a session turn's prompt is the conversation so far plus its input.
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        if out.finished:
            self.finish = out.finish_reason
            self.embedding, self.label_logprobs = out.embedding, out.label_logprobs
        return verified

    def native(self, return_logprob: bool, token_text=None) -> dict:
        """The /generate answer (and each streamed event): everything so far."""
        p = self.params
        meta = meta_info(
            self.rid,
            self.prompt_tokens,
            self.output_ids,
            self.cached_tokens,
            self.finish,
            self.logprobs if return_logprob else None,
            self.top_logprobs if return_logprob and p.top_logprobs else None,
            self.spec_verify_ct,
            self.prompt if return_logprob else None,
            token_text,
        )
        return {"text": self.visible, "output_ids": list(self.output_ids), "meta_info": meta}


class GenerationService:
    """Runs requests against the engine for the HTTP handlers."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        metrics: Metrics,
        sessions: SessionStore,
        gate: GenerationGate,
        holds_sessions: bool = True,
        inflight: InFlight | None = None,
    ):
        self.client = client
        self.inflight = inflight or InFlight(1 << 30)  # each caller's engine requests (--max-requests-per-key)
        self.gate = gate  # new requests wait here while generation is paused or weights update
        self.sessions = sessions
        # False on a PD prefill server: its engine holds no session (decode does, and checks the turn).
        self.holds_sessions = holds_sessions
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._bg: set[asyncio.Task] = set()
        self.owners: dict[str, str] = {}  # rid -> the owner tag of who started it (auth.may_abort)

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
        session_params: dict | None = None,
        owner: str | None = None,
        disagg: DisaggParams | None = None,
        pooling: PoolingParams | None = None,
        images: list[WireImage] | None = None,
    ) -> AsyncIterator[GenState]:
        """Yield the request's state after each batch of new tokens; the last one is finished.
        ``owner`` is the owner tag of who may abort it besides the admin (default: the caller's);
        ``disagg`` its bootstrap room in PD mode; ``pooling`` makes it an embedding or score request
        (its answer on the final state); ``images`` are its images (their placeholder runs are in
        ``input_ids``). A session turn must be the caller's session, with its salt
        (404 otherwise, before anything is submitted). The caller's requests in flight are counted
        while it runs (429 past --max-requests-per-key)."""
        who = current_principal().owner
        with self.inflight.hold(who):
            async for st in self._stream(input_ids, params, rid, session_params, owner or who, disagg, pooling, images):
                yield st

    async def _stream(
        self, input_ids, params, rid, session_params, owner, disagg, pooling, images=None
    ) -> AsyncIterator[GenState]:
        rid = rid or uuid.uuid4().hex
        owner = owner or current_principal().owner
        if session_params is not None and self.holds_sessions and isinstance(session_params, dict):
            self.sessions.check(
                session_params.get("id"), owner, "session_params.id", params.cache_salt, turn=True
            )
        text = TextState(self.tokenizer, params.skip_special_tokens, params.stop, not params.no_stop_trim)
        st = GenState(rid, params, text, len(input_ids))
        if params.logprob_start_len >= 0:
            st.prompt = PromptLogprobs(input_ids, params.logprob_start_len, params.top_logprobs)
        t0 = time.monotonic()
        last = None
        await self.gate.wait_open()  # holds nothing while it waits (a client may leave meanwhile)
        q = await self.client.submit(rid, input_ids, params, session_params, disagg, pooling, images)
        self.owners[rid] = owner
        try:
            while st.finish is None:
                items = [await q.get()]
                while not q.empty() and not items[-1].finished:
                    items.append(q.get_nowait())
                now = time.monotonic()
                for it in items:
                    if it.new_ids:
                        (self.metrics.ttft if last is None else self.metrics.itl).observe(now - (last or t0))
                        last = now
                    if verified := st.add(it):
                        self.metrics.observe_verify(verified)
                if st.finish is not None:
                    self._account(st, now - t0)
                    if session_params is not None:
                        self.sessions.turn_ended(session_params, input_ids, st.finish, st.output_ids, bool(images))
                st.visible = st.text.update(st.output_ids, st.finish)
                yield st
        finally:
            self.owners.pop(rid, None)
            if st.finish is None:
                # The consumer went away (client disconnect, cancelled handler): abort in the engine,
                # which releases the request through its one release path.
                self.client.streams.pop(rid, None)
                self._abort_soon(rid, "the client disconnected")
                self.metrics.aborted.labels("client_disconnect").inc()

    def _account(self, st: GenState, e2e: float) -> None:
        m = self.metrics
        m.e2e.observe(e2e)
        m.prompt_tokens.inc(st.prompt_tokens)
        m.generation_tokens.inc(len(st.output_ids))
        m.cache_hit.inc(st.cached_tokens)
        m.requests.labels(st.finish.type).inc()
        if st.finish.type == "abort":
            status = st.finish.status
            reason = ABORT_REASONS.get(status, "engine_error" if status >= 500 else "abort")
            m.aborted.labels("timeout" if st.finish.code == "request_timeout" else reason).inc()

    async def collect(
        self,
        input_ids,
        params,
        rid=None,
        disconnected=None,
        session_params=None,
        owner=None,
        disagg=None,
        pooling=None,
        images=None,
    ) -> GenState:
        """Run to completion. ``disconnected`` is polled; if it turns true the request is aborted."""

        async def run() -> GenState:
            last = None
            async for state in self.stream(input_ids, params, rid, session_params, owner, disagg, pooling, images):
                last = state
            return last

        return (await self.collect_all([run()], disconnected))[0]

    def check_room(self, count: int) -> None:
        """429 unless the caller may start ``count`` more engine requests (--max-requests-per-key)."""
        self.inflight.check_room(current_principal().owner, count)

    async def collect_all(
        self, runs: list, disconnected=None, concurrency: int | None = None, fail_fast: bool = True
    ) -> list[GenState]:
        """Await one body's runs (coroutines, each one engine request's: ``collect``), at most
        ``concurrency`` at once; their states in order. If ``disconnected`` (polled) turns true, or,
        with ``fail_fast`` (a body that fails as a whole), one fails (raises, or ends with an error:
        a full queue's 429), every other is cancelled, which aborts its engine request through the
        engine's one release path: none is left running (issue 50: a fanned-out body left 76,000
        running after its client went away). The caller's room for all of them is checked first
        (429)."""
        limit = asyncio.Semaphore(concurrency or max(1, len(runs)))
        try:
            self.check_room(min(len(runs), concurrency or len(runs)))
        except OverloadedError:
            for r in runs:
                r.close()  # never started
            raise

        async def gated(coro):
            async with limit:
                return await coro

        tasks = [asyncio.ensure_future(gated(r)) for r in runs]
        watch = asyncio.ensure_future(_until(disconnected)) if disconnected is not None else None
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending | {watch} - {None}, return_when=asyncio.FIRST_COMPLETED)
                if watch is not None and watch in done:
                    raise asyncio.CancelledError  # the client went away
                pending.discard(watch)
                for t in done:  # the first failure, raised after the rest are cancelled (finally)
                    err = t.result().error() if fail_fast else None
                    if err is not None:
                        raise err
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
            if watch is not None:
                watch.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _until(disconnected) -> None:
    """Return once ``disconnected()`` says the client has gone (polled every 0.25 s)."""
    while not await disconnected():
        await asyncio.sleep(0.25)
