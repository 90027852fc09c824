"""Requests that run their prompt and answer with something other than tokens (no decode phase):
an embedding (``/v1/embeddings``, ``/v1/rerank``) or the next-token logprobs of label tokens
(``/v1/score``). Their parameters, their one validation, and the embedding's final form."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ..errors import ValidationError

POOLING_METHODS = ("last", "mean")
MAX_LABEL_TOKENS = 1024  # label tokens of one score request (their logprobs travel back per item)


class PoolingParams(msgspec.Struct, omit_defaults=True):
    """One of the two (the other None):

    ``embed``: the prompt's final-norm hidden states (before the LM head) pooled — ``last``: the last
    token's; ``mean``: the mean over every token — and L2-normalised.
    ``label_token_ids``: the log-probability of each of these tokens at the position after the prompt
    (the model's next-token distribution over the whole vocabulary: SGLang's ``/v1/score``).
    """

    embed: str | None = None
    label_token_ids: list[int] | None = None

    @property
    def mean(self) -> bool:
        return self.embed == "mean"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_pooling(p: Any, vocab_size: int) -> PoolingParams:
    """The one check of a pooling request's parameters (front and engine)."""
    if not isinstance(p, PoolingParams):
        raise ValidationError("pooling parameters must be a PoolingParams", param="pooling")
    if (p.embed is None) == (p.label_token_ids is None):
        raise ValidationError("give exactly one of embed and label_token_ids", param="pooling")
    if p.embed is not None and p.embed not in POOLING_METHODS:
        raise ValidationError(
            f"pooling must be one of {', '.join(POOLING_METHODS)}, got {p.embed!r}", param="pooling"
        )
    ids = p.label_token_ids
    if ids is not None:
        if not isinstance(ids, list) or not ids or len(ids) > MAX_LABEL_TOKENS:
            raise ValidationError(
                f"label_token_ids must be a list of 1 to {MAX_LABEL_TOKENS} token ids", param="label_token_ids"
            )
        bad = next((t for t in ids if not _is_int(t) or not 0 <= t < vocab_size), None)
        if bad is not None or any(not _is_int(t) for t in ids):
            raise ValidationError(
                f"label token id {bad!r} is not an integer in [0, {vocab_size})",
                param="label_token_ids",
                code="invalid_token_id",
            )
    return p


def normalized(pooled: np.ndarray, count: int, mean: bool) -> list[float]:
    """The embedding a client receives: the pooled vector (a sum over ``count`` positions for the
    mean), L2-normalised, as float32 values."""
    v = pooled / count if mean else pooled
    norm = float(np.linalg.norm(v))
    return (v / max(norm, 1e-12)).astype(np.float32).tolist()


def score_prompts(query: Any, items: Any, item_first: bool, tokenizer=None) -> list[str] | list[list[int]]:
    """SGLang's ``/v1/score`` prompts: ``query + item`` per item (``item + query`` with ``item_first``),
    joined as text (a string query and string items) or as token ids (ids and lists of ids)."""
    if query is None or items is None:
        raise ValidationError("give query and items", param="query" if query is None else "items")
    if not isinstance(item_first, bool):
        raise ValidationError("item_first must be a boolean", param="item_first")
    if isinstance(query, str) and (isinstance(items, str) or _all(items, lambda x: isinstance(x, str))):
        texts = [items] if isinstance(items, str) else items
        return [i + query if item_first else query + i for i in texts]
    if _all(query, _is_int) and _all(items, lambda x: _all(x, _is_int)) and items:
        return [list(i) + query if item_first else query + list(i) for i in items]
    if isinstance(items, list) and not items:
        return []
    raise ValidationError(
        "query and items must be a string and strings, or token ids and lists of token ids", param="items"
    )


def _all(v: Any, pred) -> bool:
    return isinstance(v, list) and all(pred(x) for x in v)


def label_scores(logprobs: list[float], apply_softmax: bool) -> list[float]:
    """A score item's answer (SGLang's): the label tokens' probabilities, or with ``apply_softmax``
    those normalised over the label tokens alone."""
    lp = np.asarray(logprobs, dtype=np.float64)
    if apply_softmax:
        lp = lp - lp.max()
        p = np.exp(lp)
        return (p / p.sum()).tolist()
    return np.exp(lp).tolist()
