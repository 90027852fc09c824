"""A request's state machine and the messages the core emits about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """SGLang's sampling parameters, already validated (see ``validation.validate_sampling``)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True


class ReqState(enum.Enum):
    WAITING = "waiting"  # in the queue; holds no memory
    RUNNING = "running"  # admitted: holds a slot and pages (prefilling or decoding)
    FINISHED = "finished"  # released through the one release path


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    message: str | None = None
    matched: int | str | None = None  # the stop token id or stop string that ended it
    status: int = 200  # HTTP status a front should answer with when nothing was streamed yet

    def to_dict(self) -> dict:
        d: dict = {"type": self.type}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message:
            d["message"] = self.message
        return d


@dataclass(eq=False)
class Req:
    """One generation request. Memory fields are changed only by ``KVManager``."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    to_finish: FinishReason | None = None  # set by causes; acted on at the loop's safe point
    finish_reason: FinishReason | None = None
    # --- memory (KVManager) ---
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_tree_pages: int = 0  # leading pages borrowed: from the radix tree (locked) or the turn's session
    prefix_node: object | None = None  # the locked tree node
    kv_len: int = 0  # tokens whose KV is computed and stored
    cached_tokens: int = 0  # prefix-cache hit at first admission (reported)
    # --- bookkeeping ---
    generator: torch.Generator | None = None
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    num_retractions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    admitted_seq: int = 0  # admission order (retraction picks the newest)
    session_id: str | None = None
    session: object | None = None  # the Session this request is a turn of (see sessions.py)
    session_offset: int = 0
    is_health_check: bool = False

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the sequence will need: the prompt and the output so far."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    def mark_finish(self, reason: FinishReason) -> None:
        """Record why the request must end; the first cause wins. Nothing is freed here."""
        if self.to_finish is None and not self.finished:
            self.to_finish = reason


@dataclass
class StepOutput:
    """What the core says about one request after a step: new tokens and, at the end, the finish."""

    rid: str
    new_ids: list[int]
    new_logprobs: list[float | None]
    new_top_logprobs: list[list[tuple[int, float]] | None]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
