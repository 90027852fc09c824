"""The engine core: the step (intake -> schedule -> run -> commit -> release) over the parts the
composition root built (``launch/build.py``: ``EngineParts``). Runs in-process (the offline ``Engine``)
or in the engine process of the server, driven by calling ``step``. Its control verbs are
``core.control`` (``control.py``), its read-only questions ``core.view`` (``introspect.py``)."""

from __future__ import annotations

import logging
import time
import uuid

import msgspec

from ..comm import TPGroupBroken
from ..common import FinishReason, RequestOutput, SamplingParams, check_typed_request, validate_request
from ..common.pooling import PoolingParams, validate_pooling
from ..compat import check_request
from ..constrained import grammar_spec
from ..errors import KVLedgerError, NotFoundError, ValidationError
from ..multimodal import MultiModalInputs
from ..scheduler import ModelRunnerOutput, Req, SchedulerOutput
from .control import EngineControl
from .introspect import EngineView
from .overlap import ForwardThread

log = logging.getLogger(__name__)


class EngineCore:
    """Owns one model and one set of pools. No global state: several may live in one process."""

    def __init__(self, parts):
        """``parts``: an ``EngineParts`` (``launch/build.py``, named, not imported: the root is built
        above the engine)."""
        self.cfg = parts.cfg
        self.model, self.tokenizer, self.loras = parts.model, parts.tokenizer, parts.loras
        self.kv_manager, self.runner, self.executor = parts.kv_manager, parts.runner, parts.executor
        self.connector, self.disagg_connector = parts.connector, parts.disagg_connector
        self.grammars, self.scheduler, self.sessions = parts.grammars, parts.scheduler, parts.sessions
        self.limits, self.info, self.overlap = parts.limits, parts.info, parts.overlap
        self.dtype = parts.model.dtype
        self.weight_shapes = parts.weight_shapes  # what a weight update must match
        self.last_step_ran = False
        # Overlap scheduling: the forward thread, and the launched step whose result is not applied.
        self._forward = ForwardThread(self._execute, self.cfg.model.device) if self.overlap else None
        self._in_flight: tuple[SchedulerOutput, object] | None = None
        # Steps launched while the previous one ran, and steps whose result the engine waited for at
        # once because the next schedule needs it (drafts, grammars, prompt logprobs, pooling).
        self.overlap_stats = {"overlapped": 0, "synchronous": 0}
        self.control = EngineControl(self, parts.rebuild_model)
        self.view = EngineView(self)

    def close_forward(self) -> None:
        """Stop the forward thread (overlap scheduling); nothing without one."""
        if self._forward is not None:
            self._forward.shutdown()

    # -- the step: schedule -> run -> update ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.overlap:
            return self._step_overlapped()
        self.sessions.expire()
        sched = self.scheduler.schedule()
        self.last_step_ran = bool(sched.reqs)  # False: nothing to compute (waiting on a connector)
        pending = sched.reqs or sched.page_writes or sched.hisparse or sched.image_drops or self.scheduler.has_pending_kv
        result = self._execute(sched) if pending else None
        return self.scheduler.update(sched, result)

    def _step_overlapped(self) -> list[RequestOutput]:
        """Overlap scheduling (``scheduler/overlap.py``): schedule and launch step N+1, then apply step
        N's result while N+1 runs. Synchronous where N+1 needs N's result first (``needs_sync``), and
        for a step that computes nothing (page-table changes only)."""
        s = self.scheduler
        self.sessions.expire()
        outs = self.wait_in_flight() if s.needs_sync else []
        sched = s.schedule()
        self.last_step_ran = bool(sched.reqs)
        if not sched.reqs:
            outs += self.wait_in_flight()
            pending = sched.page_writes or sched.hisparse or sched.image_drops or s.has_pending_kv
            return outs + s.update(sched, self._execute(sched) if pending else None)
        launched = (sched, self._forward.submit(sched))
        overlapped = self._in_flight is not None
        outs += self.wait_in_flight()
        self._in_flight = launched
        if s.needs_sync:
            # The next schedule needs this step's result (drafts, a grammar, ...): wait for it now, so
            # its outputs go out with this step, as in a synchronous step.
            self.overlap_stats["synchronous"] += 1
            outs += self.wait_in_flight()
        elif overlapped:
            self.overlap_stats["overlapped"] += 1
        return outs

    def wait_in_flight(self) -> list[RequestOutput]:
        """Apply the launched step's result (waiting for it); its outputs. Nothing without one."""
        if self._in_flight is None:
            return []
        sched, future = self._in_flight
        self._in_flight = None
        return self.scheduler.update(sched, future.result())

    def settle_in_flight(self) -> None:
        """Before a control call that needs the engine between steps: the launched step's result is
        applied, its outputs kept for the next step to return."""
        if self._in_flight is not None:
            self.scheduler.keep_outputs(self.wait_in_flight())

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Fault isolation: a failed step is rerun request by request (the failed forward advanced
        nothing, and rewriting the same KV locations is harmless); only the requests that fail alone
        are reported failed, and end with a 500 through the release path."""
        try:
            t0 = time.perf_counter()
            out = self.executor.execute_model(sched)
            # The forward's cost, for pacing prompt chunks beside decodes (scheduler/pacing.py).
            dec = sum(r.num_tokens for r in sched.reqs if r.sampling is not None and r.num_tokens - r.num_draft == 1)
            self.scheduler.policy.costs.observe(dec, sched.num_tokens - dec, time.perf_counter() - t0)
            return out
        except TPGroupBroken:
            raise  # the ranks are out of step: the engine process ends and the front restarts it
        except Exception:
            log.exception("a forward of %d requests failed; running them one by one", len(sched.reqs))
        out = ModelRunnerOutput.empty(len(sched.reqs))
        out.errors = [None] * len(sched.reqs)
        for i in range(len(sched.reqs)):
            try:
                one = self.executor.execute_model(sched.subset(i))
            except Exception as e:
                out.errors[i] = f"{type(e).__name__}: {e}"
                continue
            out.tokens[i], out.logprobs[i], out.top_logprobs[i] = (
                one.tokens[0],
                one.logprobs[0],
                one.top_logprobs[0],
            )
            if one.prompt_logprobs is not None:
                if out.prompt_logprobs is None:
                    out.prompt_logprobs = [[] for _ in sched.reqs]
                    out.prompt_top_logprobs = [[] for _ in sched.reqs]
                out.prompt_logprobs[i] = one.prompt_logprobs[0]
                out.prompt_top_logprobs[i] = one.prompt_top_logprobs[0]
            if one.pooled is not None:
                out.pooled = out.pooled or [None] * len(sched.reqs)
                out.pooled[i] = one.pooled[0]
            if one.label_logprobs is not None:
                out.label_logprobs = out.label_logprobs or [None] * len(sched.reqs)
                out.label_logprobs[i] = one.label_logprobs[0]
            out.finished_sending |= one.finished_sending
            out.finished_recving |= one.finished_recving
        return out

    # -- intake ---------------------------------------------------------------------------------------
    def make_request(
        self,
        input_ids,
        sampling: SamplingParams | dict | None,
        rid: str | None = None,
        pooling: PoolingParams | None = None,
        mm: MultiModalInputs | None = None,
    ) -> Req:
        """Check and build a request. ``sampling`` typed came from the front, validated there: the
        engine, the authority, checks it against its own limits (``check_typed_request``); a dict
        (the offline API's, a test's) gets the one validation here. With ``pooling`` it computes its
        prompt and answers with an embedding or label logprobs (``common/pooling.py``): a scoring
        request, whatever ``sampling`` says but its cache salt, timeout and priority. A grammar
        starts compiling here, off the engine's thread (``req.grammar_job``): the scheduler keeps the
        request aside until it is compiled, and the offline API waits for it (``wait_grammar``).
        ``mm``: its images (``multimodal/``), whose placeholder runs ``input_ids`` already holds."""
        if mm is not None:
            if self.runner.images is None:
                raise ValidationError("this model takes no images (a text-only model)", param="image_data")
            check_request(self.cfg, "images", ["pooling"] if pooling is not None else [])
        if pooling is not None:
            validate_pooling(pooling, self.limits.vocab_size)
        if isinstance(sampling, SamplingParams):
            params = sampling
            if pooling is not None:
                params = SamplingParams(
                    max_new_tokens=0, scoring=True, cache_salt=params.cache_salt, timeout=params.timeout,
                    priority=params.priority,
                )  # fmt: skip
            ids = check_typed_request(input_ids, params, self.limits)
        else:
            if pooling is not None:
                sampling = {k: v for k, v in (sampling or {}).items() if k in ("cache_salt", "timeout", "priority")}
            ids, params = validate_request(input_ids, sampling, self.limits, scoring=pooling is not None)
        rid = rid if rid is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            raise ValidationError("rid must be a non-empty string of at most 256 characters", param="rid")
        if mm is not None and mm.images[-1].end > len(ids):
            raise ValidationError("an image's tokens run past the prompt", param="image_data")
        if mm is not None:  # its M-RoPE layout where the decoder takes one (multimodal/mrope.py)
            mm = self.runner.images.encoder.with_rope(mm)
        req = Req(rid=rid, input_ids=ids, params=params, pooling=pooling, mm=mm)
        if params.lora_path is not None:
            req.lora_key = self.lora_adapter(params.lora_path).fingerprint
        spec = grammar_spec(params)
        if spec is not None:  # compiled on the backend's threads: it holds nothing until it is done
            req.grammar_job = self.grammars.start(spec, after_reasoning=params.require_reasoning)
        return req

    @staticmethod
    def wait_grammar(req: Req) -> None:
        """Block until ``req``'s grammar is compiled (the offline API, on its caller's thread): the
        compile's 400 (or its timeout's) is raised here, before the request is submitted."""
        if req.grammar_job is not None:
            job, req.grammar_job = req.grammar_job, None
            req.grammar = job.wait()

    @staticmethod
    def drop_request(req: Req) -> None:
        """Forget a request built but never submitted (another of its call failed validation)."""
        if req.grammar_job is not None:
            req.grammar_job.cancel()
            req.grammar_job = None

    def submit(self, req: Req, session_params: dict | None = None) -> None:
        """Queue a validated request; with ``session_params`` it becomes a turn of that session.
        Every refusal (409, 429, a session's 400/404/409) happens before anything is held; a PD
        request refused here is reported to its connector, which tells the other side at once."""
        try:
            self.scheduler.check_submit(req)
            if req.pooling is not None:
                if session_params is not None:
                    check_request(self.cfg, "sessions", ["pooling"])
                req.disagg = None  # computed here, whatever the server's PD role: there is nothing to send
            if req.disagg is not None:
                self._disagg_params(req, session_params)
            if session_params is not None:
                if req.params.lora_path is not None:
                    check_request(self.cfg, "adapter", ["sessions"])
                check_request(self.cfg, "sessions")  # the compatibility table, for a request-level feature
                if req.disagg is not None:
                    self._no_session_images(req, session_params)
                if req.disagg is not None and self._pd_mode == "prefill":
                    # A session turn through PD, prefill's half: the session is decode's. The request is a
                    # plain one whose prompt decode's claim supplies (``disagg/prefill.py``).
                    self.sessions.check_params(req, session_params)
                else:
                    self._attach(req, session_params)
        except KVLedgerError as e:
            if self.connector is not None and req.disagg is not None:
                self.connector.request_refused(req, e.message)
            raise
        if self.connector is not None:
            self.connector.check_request(req)  # last: it may take the request's room
        self.scheduler.submit(req)

    def _no_session_images(self, req: Req, session_params: dict) -> None:
        """A PD session turn computes its history on prefill, which holds neither the session nor its
        images: a turn with images, or of a session whose history has some, is refused (a 400)."""
        sid = session_params.get("id") if isinstance(session_params, dict) else None
        s = self.sessions.sessions.get(sid) if isinstance(sid, str) else None
        if req.mm is not None or (s is not None and s.images):
            raise ValidationError(
                "a session turn with images (or of a session whose history holds images) is not served "
                "through PD yet: the prefill server holds neither the session nor its images",
                param="session_params",
            )

    @property
    def _pd_mode(self) -> str | None:
        return self.cfg.disagg.disaggregation_mode

    def _attach(self, req: Req, session_params: dict) -> None:
        s = self.sessions.sessions.get(session_params.get("id")) if isinstance(session_params, dict) else None
        if s is not None and s.busy_rid is not None:
            # The busy turn may be on its way out (a client that disconnected and retried at once, or
            # a turn that ended while a later launched step held it): let it finish first. Between
            # steps this is a safe point.
            self.settle_in_flight()
            self.scheduler.settle()
        self.sessions.attach(req, session_params, self.limits.context_length)
        if req.mm is not None:  # the whole prompt's images (the history's too): M-RoPE's layout anew
            req.mm = self.runner.images.encoder.with_rope(req.mm)

    def _disagg_params(self, req: Req, session_params: dict | None) -> None:
        """A request with a bootstrap room on a PD server: prefill computes the prompt and one token;
        decode takes the prompt's KV and that token, so it computes no prompt logprobs (the router
        prepends prefill's). On a server that is neither, the room is ignored. A session turn on
        prefill takes its prompt from decode's claim (the session and its history are decode's)."""
        mode = self._pd_mode
        if mode is None:
            req.disagg = None
            return
        if mode == "prefill":
            req.prompt_from_claim = session_params is not None and not req.disagg.fake
            req.params = msgspec.structs.replace(req.params, max_new_tokens=min(req.params.max_new_tokens, 1))
        else:
            # The body names the prefill server: one this server may not reach is a 400 now, before
            # anything is held or connected (not an address of the client's choosing).
            check_peer = getattr(self.disagg_connector, "check_peer", None)
            if check_peer is not None:
                check_peer(req.disagg)
            req.params = msgspec.structs.replace(req.params, logprob_start_len=-1)
            req.input_logprobs.clear()
            req.input_top_logprobs.clear()

    def reject(self, rid: str, e: ValidationError) -> RequestOutput:
        """The final output of a request refused before it was queued (engine process)."""
        return RequestOutput.final(rid, FinishReason.from_error(e))

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        self.scheduler.abort(rid, message)

    def lora_adapter(self, name: str):
        """The loaded adapter ``name`` (404 when none is)."""
        adapter = None if self.loras is None else self.loras.adapters.get(name)
        if adapter is None:
            have = sorted(self.loras.adapters) if self.loras is not None else []
            raise NotFoundError(
                f"no LoRA adapter named {name!r} is loaded (loaded: {', '.join(have) or 'none'})",
                param="lora_path", code="lora_not_found",
            )  # fmt: skip
        return adapter
