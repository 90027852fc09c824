"""Building the proposer ``--speculative-algorithm`` asks for (its settings: ``config.SpeculativeSettings``)."""

from __future__ import annotations

import os

from ..config import EngineConfig, SpeculativeSettings
from ..errors import ModelLoadError, ValidationError
from .draft_model import DraftModelProposer
from .ngram import NgramProposer


def check_draft_model(spec: SpeculativeSettings) -> None:
    """Before anything starts: STANDALONE's draft model is a path that exists (read by ``make_proposer``)."""
    path = spec.speculative_draft_model_path
    if spec.draft_model and (not path or not os.path.exists(path)):
        raise ValidationError(
            f"STANDALONE needs --speculative-draft-model-path to an existing model (got {path!r})",
            param="speculative_draft_model_path",
        )


def make_proposer(cfg: EngineConfig, target, num_tokens: int):
    """None without speculation; the draft model is loaded here, in the target's dtype and device.
    The settings were checked by ``SpeculativeSettings.check`` (normalised: upper case) and
    ``check_draft_model``."""
    algo = cfg.spec.speculative_algorithm
    if algo is None:
        return None
    k = cfg.spec.speculative_num_draft_tokens
    if algo == "NGRAM":
        return NgramProposer(
            k, cfg.spec.speculative_ngram_min_match_window_size, cfg.spec.speculative_ngram_max_match_window_size
        )
    from ..model import LlamaModel, load_model  # the draft model's loader only when asked for

    draft = load_model(cfg.spec.speculative_draft_model_path, load_tokenizer=False)
    if draft.config.vocab_size != target.cfg.vocab_size:
        raise ModelLoadError(
            f"the draft model's vocabulary ({draft.config.vocab_size}) is not the target's "
            f"({target.cfg.vocab_size}): it must use the same tokenizer"
        )
    model = LlamaModel(
        draft.config, dict(draft.weights), dtype=target.dtype, device=target.device, deterministic=target.deterministic
    )
    return DraftModelProposer(model, num_tokens, cfg.cache.page_size, k)
