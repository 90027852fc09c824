"""A request's output as the offline ``Engine`` (``offline.py``) gathers it step by step, and its
result in ``/generate``'s shape (``{"text", "output_ids", "meta_info"}``, or an embedding's or a
score's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common import FinishReason, meta_info
from ..common.outputs import PromptLogprobs
from ..engine.detok import TextState
from ..scheduler import Req


@dataclass
class Track:
    """One request's outputs so far (``Engine._apply`` adds each step's); ``version`` counts the
    updates, so a stream yields only when something changed."""

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

