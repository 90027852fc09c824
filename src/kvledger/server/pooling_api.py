"""``/v1/embeddings`` (OpenAI), ``/v1/score`` (SGLang) and ``/v1/rerank`` (SGLang's and vLLM's
fields, vLLM's answer): requests that run their prompt and end, with no decode
(``common/pooling.py``). Every input is parsed and validated before any is submitted, so a bad one
allocates nothing for any of them."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np

from ..common import Limits, SamplingParams, parse_prompts, validate_request
from ..common.pooling import PoolingParams, label_scores, score_prompts, validate_pooling
from ..common.prompts import split_openai_prompt
from ..errors import ValidationError
from .admission import AdmissionLimits, check_fanout, check_prompt_tokens, prompt_count
from .generation import GenerationService, GenState
from .protocol import EmbeddingRequest, RerankRequest, ScoreRequest

RERANK_SCORE = "cosine_similarity"  # what /v1/rerank's relevance_score is (no cross-encoder here)


class PoolingServing:
    def __init__(
        self,
        gen: GenerationService,
        check_model,
        name: str,
        limits: Limits,
        tokenizer,
        pooling: str,
        max_in_flight: int,
        admission: AdmissionLimits | None = None,
        chat=None,
    ):
        """``chat``: the OpenAI serving (``openai_api.OpenAIServing``) whose chat template and image
        parts an embedding's ``messages`` go through (None: ``messages`` is refused)."""
        self.chat = chat
        self.gen = gen
        self.admission = admission or AdmissionLimits()
        self.max_in_flight = max_in_flight
        self.check_model = check_model
        self.name = name
        self.limits = limits
        self.tokenizer = tokenizer
        self.pooling = pooling  # --pooling: last | mean

    # -- shared ------------------------------------------------------------------------------------------
    def _prompts(self, text, ids, param: str, salt: str | None) -> list[tuple[list[int], SamplingParams]]:
        """Parse and validate every prompt (the one validation) before anything is submitted; ``salt``
        is the body's prefix-cache namespace (``_Salted.salt``)."""
        sampling = {"cache_salt": salt} if salt is not None else None
        check_fanout(self.admission, prompt_count(text if text is not None else ids), 1, param)
        prompts, _ = parse_prompts(text, ids, self.tokenizer, text_param=param)
        check_prompt_tokens(self.admission, prompts, param)
        jobs = []
        for i, p in enumerate(prompts):
            try:
                jobs.append(validate_request(p, sampling, self.limits, scoring=True))
            except ValidationError as e:
                where = param if len(prompts) == 1 else f"{param}.{i}"
                raise ValidationError(e.message, param=where, code=e.code) from None
        return jobs

    async def _chat_prompt(self, body: EmbeddingRequest) -> tuple[list[tuple[list[int], SamplingParams]], Any]:
        """vLLM's chat form of an embedding: ``messages`` (image parts included: read off the loop
        like chat's, each a 400 naming its part) through the chat template, as one prompt; its job
        and its images (``WireImage``s, or None)."""
        from ..multimodal.inputs import to_wire
        from .protocol import ChatRequest

        if self.chat is None:
            raise ValidationError("messages is not served here", param="messages")
        if body.input is not None:
            raise ValidationError("give input or messages, not both", param="messages")
        chat = ChatRequest.model_construct(
            messages=body.messages, add_generation_prompt=body.add_generation_prompt, continue_final_message=False,
            chat_template_kwargs=None, documents=None,
        )  # fmt: skip
        fetched = await self.chat.remote_images(chat)
        ids, mm = self.chat.chat_prompt(chat, fetched=fetched, prepared=await self.chat.read_images(chat, fetched))
        sampling = {"cache_salt": body.salt()} if body.salt() is not None else None
        check_prompt_tokens(self.admission, [ids], "messages")
        try:
            job = validate_request(ids, sampling, self.limits, scoring=True)
        except ValidationError as e:
            raise ValidationError(e.message, param="messages", code=e.code) from None
        return [job], to_wire(mm) if mm else None

    async def _run(self, base: str, jobs, pooling: PoolingParams, disconnected, images=None) -> list[GenState]:
        # At most --max-running-requests of one call in the engine at a time: a batch larger than the
        # waiting queue (--max-queued-requests) is fed to it, not refused by it with 429s.
        # One failed or the client left: the rest are aborted, not left running (collect_all).
        # ``images``: the one prompt's (the chat form's).
        runs = [self.gen.collect(ids, p, f"{base}-{i}", pooling=pooling, images=images) for i, (ids, p) in enumerate(jobs)]
        states = await self.gen.collect_all(runs, disconnected, concurrency=self.max_in_flight)
        for st in states:
            err = st.error()
            if err is not None:
                raise err
        return states

    @staticmethod
    def _usage(jobs, states: list[GenState] | None = None) -> dict[str, Any]:
        """OpenAI's usage, with the prompt tokens the prefix cache gave (as chat answers it)."""
        n = sum(len(ids) for ids, _ in jobs)
        cached = sum(st.cached_tokens for st in states or ())
        return {"prompt_tokens": n, "total_tokens": n, "prompt_tokens_details": {"cached_tokens": cached}}

    # -- /v1/embeddings ----------------------------------------------------------------------------------
    async def embeddings(self, body: EmbeddingRequest, disconnected) -> dict[str, Any]:
        self.check_model(body.model)
        if body.dimensions is not None:
            raise ValidationError(
                "dimensions is not supported: this model was not trained for Matryoshka embeddings, so a "
                "truncated embedding would be a poor one; leave dimensions out",
                param="dimensions",
                code="unsupported_parameter",
            )
        images = None
        if body.messages is not None:
            jobs, images = await self._chat_prompt(body)
        else:
            if body.input is None:
                raise ValidationError("input is required", param="input")
            try:
                text, ids = split_openai_prompt(body.input)
            except ValidationError as e:
                raise ValidationError(e.message.replace("prompt", "input"), param="input", code=e.code) from None
            jobs = self._prompts(text, ids, "input", body.salt())
        base = body.rid or body.request_id or f"embd-{uuid.uuid4().hex}"
        states = await self._run(base, jobs, PoolingParams(embed=self.pooling), disconnected, images)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(st.embedding, body.encoding_format)}
            for i, st in enumerate(states)
        ]
        return {
            "id": base,
            "object": "list",
            "created": int(time.time()),
            "model": self.name,
            "data": data,
            "usage": self._usage(jobs, states),
        }

    # -- /v1/score ---------------------------------------------------------------------------------------
    async def score(self, body: ScoreRequest, disconnected) -> dict[str, Any]:
        self.check_model(body.model)
        if body.label_token_ids is None:
            raise ValidationError("label_token_ids is required", param="label_token_ids")
        pooling = validate_pooling(PoolingParams(label_token_ids=body.label_token_ids), self.limits.vocab_size)
        prompts = score_prompts(body.query, body.items, body.item_first)
        if not prompts:
            return {"scores": [], "model": self.name, "object": "scoring", "usage": self._usage([])}
        text, ids = (prompts, None) if isinstance(prompts[0], str) else (None, prompts)
        jobs = self._prompts(text, ids, "items", body.salt())
        states = await self._run(f"score-{uuid.uuid4().hex}", jobs, pooling, disconnected)
        return {
            "scores": [label_scores(st.label_logprobs, body.apply_softmax) for st in states],
            "model": self.name,
            "object": "scoring",
            "usage": {**self._usage(jobs, states), "completion_tokens": 0},
        }

    # -- /v1/rerank --------------------------------------------------------------------------------------
    async def rerank(self, body: RerankRequest, disconnected) -> dict[str, Any]:
        self.check_model(body.model)
        if body.top_n is not None and body.top_n < 0:
            raise ValidationError("top_n must be 0 (all) or a positive integer", param="top_n")
        base = f"rerank-{uuid.uuid4().hex}"
        if not body.documents:
            return self._ranked(base, body, [], [])
        salt = body.salt()
        jobs = self._prompts(body.query, None, "query", salt) + self._prompts(body.documents, None, "documents", salt)
        states = await self._run(base, jobs, PoolingParams(embed=self.pooling), disconnected)
        q = np.asarray(states[0].embedding, dtype=np.float64)
        # Both are L2-normalised: the cosine is their dot product.
        scores = [float(np.dot(q, np.asarray(st.embedding, dtype=np.float64))) for st in states[1:]]
        return self._ranked(base, body, scores, jobs, states)

    def _ranked(self, base: str, body: RerankRequest, scores: list[float], jobs, states=None) -> dict[str, Any]:
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = []
        for i in order:
            r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                r["document"] = {"text": body.documents[i]}
            results.append(r)
        return {
            "id": base,
            "model": self.name,
            "results": results,
            "usage": self._usage(jobs, states),
            # Not a cross-encoder's relevance: the cosine similarity of the query's and each
            # document's embedding (--pooling), said in every answer.
            "score_type": RERANK_SCORE,
            "pooling": self.pooling,
        }


def _encode(v: list[float], fmt: str) -> list[float] | str:
    """``base64``: the little-endian float32 bytes, as openai-python decodes them."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return v
