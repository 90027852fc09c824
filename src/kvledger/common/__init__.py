"""Types shared by the HTTP front and the engine: sampling parameters, outputs and finish reasons,
the one validation, prompt parsing, and the messages between the two processes."""

from .outputs import FinishReason, RequestOutput, meta_info
from .prompts import parse_prompts
from .sampling import SamplingParams
from .validation import Limits, cache_salt_of, check_typed_request, validate_request, validate_sampling

__all__ = [
    "FinishReason",
    "Limits",
    "RequestOutput",
    "SamplingParams",
    "cache_salt_of",
    "check_typed_request",
    "meta_info",
    "parse_prompts",
    "validate_request",
    "validate_sampling",
]
