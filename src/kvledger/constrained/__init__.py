"""Structured outputs: grammars (JSON schema, regex, EBNF) compiled with xgrammar, one matcher per
request on the scheduler's side, token bitmasks applied batched in the sampler."""

from .bitmask import apply_token_bitmask, bitmask_width
from .grammar import GrammarBackend, grammar_spec
from .matcher import GrammarState

__all__ = ["GrammarBackend", "GrammarState", "apply_token_bitmask", "bitmask_width", "grammar_spec"]
