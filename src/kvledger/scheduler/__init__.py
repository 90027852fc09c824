"""Requests, validation, request memory management and the continuous-batching scheduler."""

from .kv_manager import KVManager
from .request import FinishReason, Req, ReqState, SamplingParams, StepOutput
from .scheduler import Scheduler
from .validation import Limits, validate_request, validate_sampling

__all__ = [
    "FinishReason",
    "KVManager",
    "Limits",
    "Req",
    "ReqState",
    "SamplingParams",
    "Scheduler",
    "StepOutput",
    "validate_request",
    "validate_sampling",
]
