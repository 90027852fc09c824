"""The offline ``Engine`` API (SGLang's shape): the engine core run in-process. Here: requests in
(``generate``, ``encode``, ``score``, ``add_request``), the steps that drive them, their results and
streams, and shutdown; each request's outputs gather in a ``Track`` (``offline_track.py``); the admin
verbs (pause, weights, LoRA, cache, sessions, views) are ``EngineAdmin``'s (``offline_admin.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ..common import RequestOutput, parse_prompts
from ..common.disagg import DisaggParams
from ..common.outputs import PromptLogprobs
from ..common.pooling import PoolingParams, label_scores, score_prompts
from ..compat import refusal_error
from ..config import EngineConfig
from ..engine.control import SHUTDOWN_DRAIN_S
from ..engine.detok import TextState
from ..errors import ConflictError, NotFoundError, ValidationError, error_for_status
from ..multimodal import MultiModalInputs
from ..multimodal.media import MediaLimits, load_image
from ..multimodal.processor import ImageProcessing
from ..scheduler import Req
from .build import start_engine
from .offline_admin import EngineAdmin
from .offline_track import Track


class Engine(EngineAdmin):
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
        images = self.core.runner.images
        # A vision-language model's processor (the family's own, saved beside it); the offline
        # caller is trusted with local files (the server allows a directory: --allowed-local-media-path).
        self.image_processing = (
            ImageProcessing.load(loaded.path if loaded is not None else cfg.model.model, images.encoder.image_token_id)
            if images
            else None
        )
        self.media_limits = MediaLimits(allowed_local_media_path="/")
        self._lock = threading.RLock()
        self._tracks: dict[str, Track] = {}

    @property
    def tokenizer(self):
        return self.core.tokenizer

    # -- requests ---------------------------------------------------------------------------------------
    def _images(self, image_data, ids_list: list[list[int]], single: bool) -> list[MultiModalInputs | None]:
        """SGLang's ``image_data``: for one prompt an image or a list of them, for a batch one entry
        (an image, a list, or None) per prompt. Each prompt's images fill its placeholder tokens in order."""
        n = len(ids_list)
        if image_data is None:
            return [None] * n
        if self.image_processing is None:
            raise ValidationError("this model takes no images (a text-only model)", param="image_data")
        per = [image_data] if single else image_data
        if not isinstance(per, list) or len(per) != n:
            raise ValidationError(f"image_data must have one entry per prompt ({n})", param="image_data")
        out: list[MultiModalInputs | None] = []
        for k, (ids, imgs) in enumerate(zip(ids_list, per)):
            imgs = [] if imgs is None else imgs if isinstance(imgs, list) else [imgs]
            params = [f"image_data[{j}]" if single else f"image_data[{k}][{j}]" for j in range(len(imgs))]
            if not imgs:
                out.append(None)
                continue
            decoded = [load_image(im, p, self.media_limits) for im, p in zip(imgs, params)]
            expanded, mm = self.image_processing.expand(ids, decoded, params)
            ids[:] = expanded
            out.append(mm)
        return out

    def _prepare(
        self, prompt, sampling_params, input_ids, rid, pooling=None, image_data=None
    ) -> tuple[list[Req], bool]:
        ids_list, single = parse_prompts(prompt, input_ids, self.core.tokenizer, text_param="prompt")
        ids_list = [list(ids) for ids in ids_list]
        mms = self._images(image_data, ids_list, single)
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
            for ids, sp, r, mm in zip(ids_list, sps, rids, mms):
                reqs.append(self.core.make_request(ids, sp, r, pooling, mm))
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
                self._tracks[r.rid] = Track(
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
        image_data=None,
    ):
        """Generate for one prompt (returns one result) or a list (returns a list, in order).
        ``image_data`` (SGLang's): images for the prompts' placeholder tokens (``_images``).

        Each result is ``{"text", "output_ids", "meta_info"}`` as in ``/generate``. With ``stream``
        (single prompt only) an iterator of such results, each holding everything so far.
        """
        reqs, single = self._prepare(prompt, sampling_params, input_ids, rid, image_data=image_data)
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
        image_data=None,
    ):
        """Embeddings (SGLang's ``Engine.encode``): ``{"embedding", "meta_info"}`` per prompt, the
        final-norm hidden states pooled (``last`` or ``mean``) and L2-normalised; batched through the
        scheduler like any request, with no decode. ``image_data``: as ``generate``'s (a vision model's
        image tokens are pooled with the rest: their rows after the decoder, as the text's)."""
        reqs, single = self._prepare(prompt, None, input_ids, rid, PoolingParams(embed=pooling), image_data)
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
        image_data=None,
    ) -> str:
        """Queue one request without waiting (drive it with ``step``); returns its rid. ``disagg``:
        its bootstrap room on a PD engine (``disagg/``); ``pooling``: an embedding or score request
        (its result is ``encode``'s, or ``{"label_logprobs", "meta_info"}``); ``image_data``: as
        ``generate``'s for one prompt."""
        reqs, _ = self._prepare(None, sampling_params, input_ids, rid, pooling, image_data)
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
