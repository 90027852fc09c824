"""A request's state machine, as the engine's scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..common import FinishReason, SamplingParams
from ..common.disagg import DisaggParams
from ..common.outputs import TopLogprobs
from ..common.pooling import PoolingParams
from ..multimodal import MultiModalInputs


class ReqState(enum.Enum):
    """Where a request is, and so what it may hold (see ``memory/req_pages.py`` for the pages)."""

    WAITING = "waiting"  # in the queue; holds no memory
    WAITING_FOR_KV = "waiting for kv"  # admitted; slot and pages held while a connector fills them
    RUNNING = "running"  # admitted: holds a slot and pages (prefilling or decoding)
    SENDING = "kv sending"  # finished; its pages stay until the connector's async save ends
    FINISHED = "finished"  # released through the one release path

    @property
    def ledger_label(self) -> str:
        """Named in the ledger's owner of this request's pages (empty for plain running)."""
        return self.value if self in (ReqState.WAITING_FOR_KV, ReqState.SENDING) else ""


@dataclass
class SpecState:
    """A request's speculative-decoding record (see ``spec/ngram.py`` for the adaptive rule)."""

    verify_ct: int = 0  # steps that verified drafts for it
    drafted: int = 0
    accepted: int = 0
    ema: float = 1.0  # moving average of the fraction of drafts accepted
    paused_until: int = 0  # no drafts before this many output tokens
    draft_end: int = 0  # draft model: positions [0, draft_end) hold its K/V (spec/draft_model.py)
    draft_admit: int = -1  # ... as of this admission

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_ct += 1
        self.drafted += drafted
        self.accepted += accepted
        self.ema = 0.7 * self.ema + 0.3 * accepted / drafted


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
    # Sliding windows (memory/window.py): pages after the borrowed ones given back out of window
    # (their entries OUT_OF_WINDOW), and the tree node where the prefix they went into ends.
    num_out_pages: int = 0
    window_node: object | None = None
    kv_len: int = 0  # tokens whose KV is computed and stored
    cached_tokens: int = 0  # prefix-cache hit at first admission (reported)
    num_external_tokens: int = 0  # tokens a KV connector is loading (WAITING_FOR_KV)
    kv_trusted: bool = True  # False: KV that no forward or verified transfer wrote (never cached)
    sparse: object | None = None  # HiSparse: its host and hot pages (memory/sparse_kv.py SparseHold)
    # --- bookkeeping ---
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    # Prompt logprobs of tokens logprob_start_len.. (None for token 0), filled chunk by chunk.
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    num_retractions: int = 0
    admitted_seq: int = 0  # admission order (retraction picks the newest)
    arrival_seq: int = 0  # arrival order at the scheduler (fcfs; kept through retractions)
    # Smaller is more important (scheduler/queue_order.py: the priority as the queue sorts it); 0 for
    # every request without priority scheduling.
    priority_rank: int = 0
    session: object | None = None  # the Session this request is a turn of (memory/session_kv.py)
    # The LoRA adapter's namespace in the prefix cache (its files' fingerprint; None: the base model),
    # set by the engine when it resolves ``params.lora_path``.
    lora_key: str | None = None
    session_offset: int = 0
    spec: SpecState = field(default_factory=SpecState)
    grammar: object | None = None  # structured outputs: its GrammarState (constrained/grammar.py)
    # ... while its grammar compiles off the engine thread: the GrammarJob (the request waits in the
    # scheduler's ``compiling`` list, holding nothing, until the job gives its state or fails).
    grammar_job: object | None = None
    stop_patterns: list | None = None  # its stop_regex patterns compiled by RE2 (scheduler/stop.py)
    disagg: DisaggParams | None = None  # PD: the room its KV goes to / comes from (disagg/)
    # PD prefill, a session turn: the session is decode's, so the prompt is the one decode's claim
    # carries (history + this input), taken before admission (``disagg/prefill.py``).
    prompt_from_claim: bool = False
    # time.monotonic() past which the request ends with a 503 (its timeout or the server's); None: never.
    deadline: float | None = None
    timeout_s: float = 0.0  # the limit that set the deadline (named in the message)
    # --- a request without decode (common/pooling.py): an embedding or label logprobs ---
    mm: MultiModalInputs | None = None  # its images: runs of placeholder tokens (multimodal/)
    pooling: PoolingParams | None = None
    pooled: object | None = None  # numpy float64: the last position's hidden state, or the mean's sum
    pooled_count: int = 0  # positions [0, pooled_count) are in ``pooled`` (mean pooling)
    label_logprobs: list[float] | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the sequence will need: the prompt and the output so far."""
        return self.input_ids + self.output_ids

    @property
    def next_prompt_logprob(self) -> int | None:
        """The prompt token whose logprob is still to be computed (None: none is wanted)."""
        s = self.params.logprob_start_len
        if s < 0:
            return None
        t = s + len(self.input_logprobs)  # token 0's None is there from the start
        return t if t < len(self.input_ids) else None

    @property
    def reuse_limit(self) -> int:
        """Leading tokens whose KV may come from a cache or a session: all but the last (so there are
        logits to sample from), and none at or past the position that computes a wanted prompt
        logprob (a cached prefix has no logits: vLLM #5344)."""
        n = len(self.fill_ids) - 1
        if self.pooling is not None and self.pooling.mean:
            # Mean pooling needs every position's hidden state, and a cached prefix has none: only what
            # is already summed (before a retraction) may come from the cache.
            n = min(n, self.pooled_count)
        t = self.next_prompt_logprob
        return n if t is None else min(n, t - 1)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of the sequence, without concatenating prompt and output."""
        lp = len(self.input_ids)
        if start >= lp:
            return self.output_ids[start - lp : end - lp]
        if end <= lp:
            return self.input_ids[start:end]
        return self.input_ids[start:] + self.output_ids[: end - lp]

    def __post_init__(self) -> None:
        if self.params.logprob_start_len == 0:
            self.input_logprobs.append(None)  # the first token has no logprob: nothing precedes it
            self.input_top_logprobs.append(None)

    def mark_finish(self, reason: FinishReason) -> None:
        """Record why the request must end; the first cause wins. Nothing is freed here."""
        if self.to_finish is None and self.state not in (ReqState.FINISHED, ReqState.SENDING):
            self.to_finish = reason
