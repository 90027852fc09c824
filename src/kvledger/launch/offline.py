"""The offline ``Engine`` API (SGLang's shape): the engine core run in-process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..common import FinishReason, RequestOutput, meta_info, parse_prompts
from ..common.disagg import DisaggParams
from ..common.outputs import PromptLogprobs
from ..common.pooling import PoolingParams, label_scores, score_prompts
from ..compat import refusal_error
from ..config import EngineConfig
from ..engine.control import SHUTDOWN_DRAIN_S
from ..engine.detok import TextState
from ..errors import ConflictError, KVLedgerError, NotFoundError, ValidationError, error_for_status
from ..scheduler import Req
from .build import start_engine


@dataclass
class _Track:
    req: Req
    text: TextState
    output_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish: FinishReason | None = None
    cached_tokens: int = 0
    spec_verify_ct: int = 0
    version: int = 0
    prompt: PromptLogprobs | None = None
    embedding: list[float] | None = None
    label_logprobs: list[float] | None = None

    def result(self) -> dict:
        p = self.req.params
        if self.req.pooling is not None:  # SGLang's encode() answer: the embedding and meta_info
            meta = meta_info(self.req.rid, len(self.req.input_ids), [], self.cached_tokens, self.finish)
            if self.req.pooling.embed is not None:
                return {"embedding": self.embedding, "meta_info": meta}
            return {"label_logprobs": self.label_logprobs, "meta_info": meta}
        meta = meta_info(
            self.req.rid,
            len(self.req.input_ids),
            self.output_ids,
            self.cached_tokens,
            self.finish,
            self.logprobs if p.wants_logprobs else None,
            self.top_logprobs if p.top_logprobs else None,
            self.spec_verify_ct,
            self.prompt,
        )
        return {
            "text": self.text.update(self.output_ids, self.finish),
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }


class Engine:
    """In-process engine::

    eng = kvledger.Engine(model=None, page_size=16, max_total_tokens=8192)
    eng.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", **kwargs):
        loaded = kwargs.pop("loaded_model", None)
        connector = kwargs.pop("kv_connector", None)  # a KVConnector (connector/base.py); None: no-op
        # engine/graph_runner.py GraphCapture; None: CUDA graphs on CUDA (the tests pass EagerCapture)
        capture = kwargs.pop("graph_capture", None)
        cfg = EngineConfig.from_flat(model=model, dtype=dtype, **kwargs)
        self.core = start_engine(cfg, loaded=loaded, connector=connector, graph_capture=capture)
        self._lock = threading.RLock()
        self._tracks: dict[str, _Track] = {}

    @property
    def tokenizer(self):
        return self.core.tokenizer

    # -- requests ---------------------------------------------------------------------------------------
    def _prepare(self, prompt, sampling_params, input_ids, rid, pooling=None) -> tuple[list[Req], bool]:
        ids_list, single = parse_prompts(prompt, input_ids, self.core.tokenizer, text_param="prompt")
        n = len(ids_list)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(sps) != n:
            raise ValidationError(f"{len(sps)} sampling_params for {n} prompts", param="sampling_params")
        rids = rid if isinstance(rid, list) else [rid] * n if rid is None else [rid]
        if len(rids) != n:
            raise ValidationError(f"{len(rids)} rids for {n} prompts", param="rid")
        # Validate everything before submitting anything: a bad item allocates nothing for any item.
        # Grammars compile on the backend's threads; this call waits for them (the engine's steps,
        # driven by other callers, go on meanwhile), so a grammar's 400 is raised here too.
        reqs: list[Req] = []
        try:
            for ids, sp, r in zip(ids_list, sps, rids):
                reqs.append(self.core.make_request(ids, sp, r, pooling))
            if len({r.rid for r in reqs}) != len(reqs):
                raise ValidationError("duplicate rid in one call", param="rid")
            for r in reqs:
                self.core.wait_grammar(r)
        except BaseException:
            for r in reqs:
                self.core.drop_request(r)
            raise
        return reqs, single

    def _submit(self, reqs: list[Req], session_params: dict | None = None) -> None:
        with self._lock:
            for r in reqs:
                self.core.submit(r, session_params)
                p = r.params
                self._tracks[r.rid] = _Track(
                    r,
                    TextState(self.core.tokenizer, p.skip_special_tokens, p.stop, not p.no_stop_trim),
                    prompt=PromptLogprobs(r.input_ids, p.logprob_start_len, p.top_logprobs)
                    if p.logprob_start_len >= 0
                    else None,
                )

    def _apply(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            t = self._tracks.get(o.rid)
            if t is None:
                continue
            t.output_ids.extend(o.new_ids)
            t.logprobs.extend(o.new_logprobs)
            t.top_logprobs.extend(o.new_top_logprobs)
            if t.prompt is not None:
                t.prompt.add(o)
            t.cached_tokens = o.cached_tokens
            t.spec_verify_ct = o.spec_verify_ct
            if o.finished:
                t.finish = o.finish_reason
                t.embedding, t.label_logprobs = o.embedding, o.label_logprobs
            t.version += 1

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            outs = self.core.step()
            self._apply(outs)
        if not self.core.last_step_ran and not outs and self.core.scheduler.has_pending_kv:
            # Only waiting on a connector's I/O thread (a transfer, a file read): yield the GIL and
            # the core to it instead of spinning (the engine process polls every 2 ms the same way).
            time.sleep(0.001)
        return outs

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        session_params: dict | None = None,
    ):
        """Generate for one prompt (returns one result) or a list (returns a list, in order).

        Each result is ``{"text", "output_ids", "meta_info"}`` as in ``/generate``. With ``stream``
        (single prompt only) an iterator of such results, each holding everything so far.
        """
        reqs, single = self._prepare(prompt, sampling_params, input_ids, rid)
        if session_params is not None and not single:
            raise refusal_error("sessions", "several_prompts", param="session_params")
        if self.core.scheduler.paused is not None:
            # Waiting here would wait for ever: nothing else steps an offline engine.
            raise ConflictError(
                "generation is paused: call continue_generation() first, or queue with add_request",
                code="generation_paused",
            )
        if stream:
            if not single:
                raise ValidationError("stream=True takes a single prompt", param="stream")
            self._submit(reqs, session_params)
            return self._stream(reqs[0].rid)
        results = self._run(reqs, session_params)
        return results[0] if single else results

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        pooling: str = "last",
        rid: str | list[str] | None = None,
    ):
        """Embeddings (SGLang's ``Engine.encode``): ``{"embedding", "meta_info"}`` per prompt, the
        final-norm hidden states pooled (``last`` or ``mean``) and L2-normalised; batched through the
        scheduler like any request, with no decode."""
        reqs, single = self._prepare(prompt, None, input_ids, rid, PoolingParams(embed=pooling))
        results = self._run(reqs)
        return results[0] if single else results

    def score(
        self,
        query: str | list[int] | None = None,
        items: str | list[str] | list[list[int]] | None = None,
        label_token_ids: list[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """SGLang's ``Engine.score``: per item, the probability of each label token right after
        ``query + item`` (``item + query`` with ``item_first``); with ``apply_softmax`` normalised over
        the label tokens."""
        prompts = score_prompts(query, items, item_first, self.core.tokenizer)
        text, ids = (prompts, None) if prompts and isinstance(prompts[0], str) else (None, prompts)
        if not prompts:
            return []
        reqs, _ = self._prepare(text, None, ids, None, PoolingParams(label_token_ids=label_token_ids))
        out = []
        for r in self._run(reqs):
            if r["label_logprobs"] is None:
                raise error_for_status(503, r["meta_info"]["finish_reason"].get("message") or "aborted")
            out.append(label_scores(r["label_logprobs"], apply_softmax))
        return out

    def _run(self, reqs: list[Req], session_params: dict | None = None) -> list[dict]:
        """Submit ``reqs`` and step until all have finished; their results in order."""
        self._submit(reqs, session_params)
        try:
            while any(self._tracks[r.rid].finish is None for r in reqs):
                self._step()
            results = [self._tracks[r.rid].result() for r in reqs]
        finally:
            for r in reqs:
                if self._tracks[r.rid].finish is None:
                    self.core.abort(r.rid, "the caller stopped waiting")
                    while self._tracks[r.rid].finish is None:
                        self._step()
                self._tracks.pop(r.rid, None)
        return results

    def _stream(self, rid: str) -> Iterator[dict]:
        seen = 0
        try:
            while True:
                t = self._tracks[rid]
                if t.version != seen:
                    seen = t.version
                    yield t.result()
                if t.finish is not None:
                    return
                self._step()
        finally:
            t = self._tracks.get(rid)
            if t is not None and t.finish is None:
                # The consumer went away: abort through the one release path, then drain.
                self.core.abort(rid, "the stream was closed")
                while t.finish is None:
                    self._step()
            self._tracks.pop(rid, None)

    def add_request(
        self,
        input_ids: list[int],
        sampling_params: dict | None = None,
        rid: str | None = None,
        session_params: dict | None = None,
        disagg: DisaggParams | None = None,
        pooling: PoolingParams | None = None,
    ) -> str:
        """Queue one request without waiting (drive it with ``step``); returns its rid. ``disagg``:
        its bootstrap room on a PD engine (``disagg/``); ``pooling``: an embedding or score request
        (its result is ``encode``'s, or ``{"label_logprobs", "meta_info"}``)."""
        reqs, _ = self._prepare(None, sampling_params, input_ids, rid, pooling)
        reqs[0].disagg = disagg
        self._submit(reqs, session_params)
        return reqs[0].rid

    def result(self, rid: str, pop: bool = True) -> dict | None:
        """The result of a request queued with ``add_request`` once it finished (None before)."""
        with self._lock:
            t = self._tracks.get(rid)
            if t is None or t.finish is None:
                return None
            if pop:
                self._tracks.pop(rid)
            return t.result()

    def abort(self, rid: str) -> None:
        """Abort a request in any state; it ends with finish_reason abort through the release path."""
        if rid not in self.core.scheduler.reqs and rid not in self._tracks:
            raise NotFoundError(f"no running request with id {rid!r}", param="rid")
        self.core.abort(rid)

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration (for callers that drive the loop themselves); returns what
        happened to requests in it."""
        return self._step()

    def run_until_idle(self) -> None:
        """Step until nothing is left to do. While generation is paused, one step (it ends what an
        abort or a pause with mode abort marked) and no more: paused requests stay. Outputs the last
        step kept (it raised in strict mode after its releases completed) are delivered too."""
        while not self.core.scheduler.idle or self.core.scheduler.has_outputs:
            self._step()
            if self.core.scheduler.paused is not None:
                return

    # -- pause and weight updates (SGLang's shapes) -------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating: ``abort`` ends every request (at the next step), ``retract`` requeues the
        running ones (recomputed, with the same output, after ``continue_generation``), ``in_place``
        keeps them where they are. Requests added meanwhile wait."""
        with self._lock:
            self.core.control.pause_generation(mode)

    def continue_generation(self) -> None:
        with self._lock:
            self.core.control.continue_generation()

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str, int]:
        """New weights from ``model_path`` (same architecture and shapes) without a restart; the prefix
        cache is flushed and sessions' KV dropped. As SGLang, when generation is not paused the
        requests in flight finish first. Returns ``(success, message, num_paused_requests)``."""
        with self._lock:
            if self.core.scheduler.paused is None:
                self.run_until_idle()
            try:
                n = self.core.control.update_weights_from_disk(model_path, load_format)["num_paused_requests"]
            except KVLedgerError as e:
                return False, e.message, 0
        return True, f"Succeeded to update model weights from {model_path}.", n

    # -- LoRA adapters (SGLang's /load_lora_adapter, /unload_lora_adapter) ----------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Serve the peft adapter at ``lora_path`` as ``lora_name`` (``sampling["lora_path"]`` selects it)."""
        with self._lock:
            return self.core.control.load_lora_adapter(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving ``lora_name``; refused (409) while requests of it are queued or running."""
        with self._lock:
            self.core.control.unload_lora_adapter(lora_name)

    def flush_cache(self) -> bool:
        with self._lock:
            return self.core.control.flush_cache()

    def memory(self) -> dict:
        with self._lock:
            return self.core.view.memory()

    def audit(self):
        with self._lock:
            return self.core.view.audit()

    def page_map(self) -> dict:
        """Every page's owner as runs, with the figures of the same instant (``/memory/pages``)."""
        with self._lock:
            return self.core.view.page_map()

    def open_session(
        self, session_id: str | None = None, streaming: bool = True, timeout: float | None = None
    ) -> str:
        """Open a streaming session (its turns keep their KV for the next turn); returns its id."""
        if streaming is not True:
            raise ValidationError("only streaming sessions are supported", param="streaming")
        with self._lock:
            return self.core.control.open_session(session_id, timeout)

    def close_session(self, session_id: str) -> None:
        """Close a session; if a turn is running its memory is released when that turn finishes."""
        with self._lock:
            self.core.control.close_session(session_id)

    def restore_sessions(self, records: list[dict]) -> int:
        """Re-open sessions from ``{id, timeout, tokens}`` records (no KV: their next turns recompute)."""
        with self._lock:
            return self.core.control.restore_sessions(records)

    def sessions(self) -> list[dict]:
        with self._lock:
            return self.core.sessions.describe()

    def shutdown(self, drain_timeout_s: float = SHUTDOWN_DRAIN_S) -> None:
        """Abort what runs, drain (bounded: see ``EngineControl.shutdown``), close."""
        with self._lock:
            for rid in list(self._tracks):
                self.core.abort(rid, "engine shut down")
            end = time.monotonic() + drain_timeout_s
            while not self.core.scheduler.idle and time.monotonic() < end:
                self._apply(self.core.step())
            self.core.control.shutdown(max(0.0, end - time.monotonic()))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
