"""Building the proposer ``--speculative-algorithm`` asks for, and checking its settings."""

from __future__ import annotations

import os

from ..config import EngineConfig
from ..errors import ModelLoadError, ValidationError
from .draft_model import DraftModelProposer
from .ngram import NgramProposer

ALGORITHMS = ("NGRAM", "STANDALONE")


def check_spec_config(cfg: EngineConfig) -> None:
    """The checks that need no model (the CLI runs them before starting anything)."""
    algo = cfg.speculative_algorithm
    if algo is None:
        return
    if algo.upper() not in ALGORITHMS:
        raise ValidationError(
            f"speculative_algorithm must be one of {', '.join(ALGORITHMS)} or unset, got {algo!r}",
            param="speculative_algorithm",
        )
    if not 1 <= cfg.speculative_num_draft_tokens <= 16:
        raise ValidationError(
            "speculative_num_draft_tokens must be in [1, 16]", param="speculative_num_draft_tokens"
        )
    lo, hi = cfg.speculative_ngram_min_match_window_size, cfg.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ValidationError(
            f"need 1 <= speculative_ngram_min_match_window_size ({lo}) <= ..._max_match_window_size ({hi})",
            param="speculative_ngram_min_match_window_size",
        )
    path = cfg.speculative_draft_model_path
    if algo.upper() == "STANDALONE" and (not path or not os.path.exists(path)):
        raise ValidationError(
            f"STANDALONE needs --speculative-draft-model-path to an existing model (got {path!r})",
            param="speculative_draft_model_path",
        )


def make_proposer(cfg: EngineConfig, target, num_tokens: int):
    """None without speculation; the draft model is loaded here, in the target's dtype and device.
    The settings were checked by ``check_spec_config`` (via ``EngineCore``'s ``check_config``)."""
    algo = (cfg.speculative_algorithm or "").upper()
    if not algo:
        return None
    k = cfg.speculative_num_draft_tokens
    if algo == "NGRAM":
        return NgramProposer(
            k, cfg.speculative_ngram_min_match_window_size, cfg.speculative_ngram_max_match_window_size
        )
    from ..model import LlamaModel, load_model  # the draft model's loader only when asked for

    draft = load_model(cfg.speculative_draft_model_path, load_tokenizer=False)
    if draft.config.vocab_size != target.cfg.vocab_size:
        raise ModelLoadError(
            f"the draft model's vocabulary ({draft.config.vocab_size}) is not the target's "
            f"({target.cfg.vocab_size}): it must use the same tokenizer"
        )
    model = LlamaModel(draft.config, dict(draft.weights), dtype=target.dtype, device=target.device)
    return DraftModelProposer(model, num_tokens, cfg.page_size, k)
