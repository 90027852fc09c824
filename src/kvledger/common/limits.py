"""The engine's bounds on one request, which the front and the engine validate against alike.

The engine builds them from its model and settings (``launch/build.py``) and sends them to the
front in ``messages.Ready``; both run the one validation (``validation.py``) with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .grammar_bounds import MAX_GRAMMAR_DEPTH, MAX_GRAMMAR_LEN


@dataclass
class Limits:
    vocab_size: int
    context_length: int
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_top_logprobs: int = 20
    max_stop_token_ids: int = 64
    max_grammar_len: int = MAX_GRAMMAR_LEN
    max_grammar_depth: int = MAX_GRAMMAR_DEPTH
    reasoning_parser: str | None = None  # the server's --reasoning-parser (require_reasoning needs one)
