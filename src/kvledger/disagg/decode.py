"""The decode side: pre-allocate a request's slot and pages, claim its room at the prefill server,
write the arriving KV straight into those pages, then join the request to decoding with the first
token prefill sampled.

Ledger: from admission until the KV is in, the request holds its slot and pages in the state
``req X [waiting for kv]`` (the scheduler's WAITING_FOR_KV). Every way out goes through the one
release path: the transfer completes (the request decodes on; a request already finished by its
first token -- max_new_tokens 1, EOS -- ends at once, the "prebuilt" finish of seed 003), the prefill
side fails or refuses, the wait times out, or the client aborts. An abort takes the job's lock, so
no frame is written into pages after they were released.

Under tensor parallelism (``tp.py``) the frames are staged on rank 0 instead (one block of every head
per request, exactly its claimed tokens), and the step after the last frame places each rank's heads
into the pages; the request is reported received after that step.

What is checked of the frames, and the I/O thread that receives them, are in ``decode_receive.py``.
"""

from __future__ import annotations

import time

from ..common.disagg import PrefillPeers
from ..connector import KVConnector, Received
from ..errors import ConflictError
from ..memory.pools import KVBuffer
from . import kv_copy, wire
from .decode_receive import AbortFn, DecodeReceiver, RecvJob
from .tp import PDMeta, RankHeads


class DecodeConnector(DecodeReceiver, KVConnector):
    """The engine thread's side (the scheduler's hooks) and rank 0's worker side of the decode
    connector; the I/O thread that receives the KV is ``DecodeReceiver``."""

    external_tokens_are_cached = False  # prefill computed (or cached) them: it says which in Done

    def __init__(
        self,
        kv: KVBuffer,
        page_size: int,
        default_port: int,
        timeout_s: float,
        abort: AbortFn,
        data=None,
        heads: RankHeads | None = None,
        kv_heads: int | None = None,
        key: bytes | None = None,
        peers: PrefillPeers | None = None,
        host_sink=None,
    ):
        """``key``: the PD nodes' shared key (``auth.py``; None: unauthenticated, loopback only);
        ``peers``: the prefill servers a request may name (None: loopback at ``default_port``);
        ``host_sink``: HiSparse's ``SparseWorker`` (``model/hisparse.py``), whose host pool KV may land in."""
        super().__init__(kv, timeout_s, abort, heads, kv_heads, key, host_sink)
        self.page_size, self.default_port = page_size, default_port
        self.peers = peers or PrefillPeers(None, default_port)
        self.data = data  # a MooncakeData (mooncake.py): claims ask prefill to write the pages directly
        self._placing: list[RecvJob] = []  # received whole (``_to_place``), placed by the step being run
        self._meta_at = 0.0  # when that step's meta was built (TransferStats.tp_copy_seconds)
        self._start_io()

    def _addr(self, d) -> str:
        return self.peers.address(d)

    # -- scheduler side (engine thread) -----------------------------------------------------------------
    def check_peer(self, d) -> None:
        """400 (``bootstrap_host``) unless ``d`` names a prefill server this side may connect to: checked
        when the request is submitted, before anything is held or connected."""
        self.peers.check(d)

    def check_request(self, req) -> None:
        d = req.disagg
        if d is None or d.fake:
            return
        with self._lock:
            if d.room in self._live:
                raise ConflictError(f"bootstrap_room {d.room} is already in use", param="bootstrap_room")
            self._live[d.room] = req.rid

    def request_refused(self, req, why: str) -> None:
        d = req.disagg
        if d is None or d.fake or not self.peers.allows(d):
            return  # (a peer it may not reach is not told either)
        # Refused here (a session turn too long, its session busy or gone, the queue full): the
        # prefill side's request for this room would otherwise wait out its bootstrap timeout.
        self.io.post(("send", self._addr(d), wire.Fail(d.room, f"the decode server refused the request: {why}")))

    @property
    def lands_in_host(self) -> bool:
        """KV for a HiSparse request can be written into its host pages (the built-in transport, one
        rank; Mooncake writes registered KV-pool memory, and TP stages heads per rank)."""
        return self.host_sink is not None and self.data is None and self.heads is None

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int, bool]:
        if req.disagg is None or req.output_ids or req.rid in self._received:
            return 0, False  # a direct request, or one retracted after its KV came: computed here
        return len(req.input_ids) - num_computed_tokens, True  # all of it, and prefill's first token

    def update_state_after_alloc(self, req, pages: list[int], num_external_tokens: int) -> None:
        d = req.disagg
        # The rest of the prompt: what decode's own cache (its prefix match, a tier's load before
        # this part) does not hold.
        end = len(req.input_ids)
        start = end - num_external_tokens
        if d.fake:
            # A health check: no KV moves. The pages hold whatever they held, so the request's KV
            # must never reach the prefix cache.
            req.kv_trusted = False
            with self._lock:
                self._first[req.rid] = wire.Done(d.room, end, 0)
                self._recv_done.add(req.rid)
            return
        if not self.peers.allows(d):  # refused at submit (check_peer); never connect there
            why = f"bootstrap_host {d.host} is not an allowed prefill server"
            self.abort(req.rid, why, 400, "bootstrap_host")
            return
        ps = self.page_size
        to_host = req.sparse is not None and req.sparse.host_from is not None  # (``lands_in_host``)
        locs = kv_copy.locations(req.sparse.host if to_host else req.pages, ps, start, end)
        job = RecvJob(
            req.rid, d.room, self._addr(d), start, end, locs, time.monotonic() + self.timeout_s, start
        )
        job.to_host = to_host
        target = None
        if self.data is not None:
            target = self.data.target(req.pages[start // ps : -(-end // ps)], ps)
            job.direct = True
        with self._lock:
            self._jobs[d.room] = job
        # A session turn's prompt is the session's history + its input: only this side knows it, so
        # the claim carries it (prefill was sent the turn's input alone). ``start`` is what the
        # session's borrowed pages already hold; prefill sends the rest.
        tokens = list(req.input_ids) if req.session is not None else None
        claim = wire.Claim(d.room, end, start, wire.prompt_crc(req), self.layout, target, tokens)
        self.io.post(("send", job.addr, claim))

    def received_output(self, req):
        with self._lock:
            done = self._first.pop(req.rid, None)
        if done is None:
            return None
        # A peer's number is clamped to the prompt: it only ever feeds a usage figure.
        cached = min(max(done.cached_tokens, 0), len(req.input_ids))
        return Received([done.first_token], [done.logprob], [done.top_logprobs], cached)

    def request_finished(self, req) -> bool:
        d = req.disagg
        if d is None:
            return False
        with self._lock:
            self._live.pop(d.room, None)
            self._first.pop(req.rid, None)
            self._recv_done.discard(req.rid)
            received = req.rid in self._received
            self._received.discard(req.rid)
            job = self._jobs.pop(d.room, None) if not d.fake else None
        if job is not None:
            with job.lock:  # after this no frame is written into the request's pages
                job.cancelled = True
            self._unstage(job)
        if not d.fake and not received and (job is None or not job.done):
            # Ended before its KV came (aborted, refused in the queue, needs none): let prefill free.
            drain = job is not None and job.direct and not job.prefill_stopped
            if drain:
                # Prefill may be writing into these pages right now: keep them until it says it
                # stopped (or the timeout passes). Noted before the Fail goes: its answer may come
                # back at once (a claim prefill had not started on).
                with self._lock:
                    self._draining[d.room] = (req.rid, time.monotonic() + self.timeout_s)
            self.io.post(("send", self._addr(d), wire.Fail(d.room, _why(req.to_finish))))
            return drain
        return False

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            done, self._recv_done = self._recv_done, set()
            self._received |= done
            drained, self._drained = self._drained, set()
        return drained, done

    def close(self) -> None:
        self.io.close()

    def build_connector_meta(self, sched_out) -> PDMeta | None:
        """Tensor parallel: the received blocks every rank places its heads of in this step."""
        if self.heads is None:
            return None
        with self._lock:
            jobs, self._to_place = [j for j in self._to_place if not j.cancelled], []
            for j in jobs:
                if j.staged is None:  # nothing to place (decode's own cache had it all)
                    self._first[j.rid] = j.first
                    self._recv_done.add(j.rid)
            self._placing = [j for j in jobs if j.staged is not None]
        if not self._placing:
            return None
        self._meta_at = time.perf_counter()
        return PDMeta(self.layout.kv_heads, place=[j.locs for j in self._placing])

    @property
    def has_pending(self) -> bool:
        return bool(self._to_place or self._placing)

    def _unstage(self, job: RecvJob) -> None:
        with self._lock:
            if job.staged is not None:
                self.stats.stage(-job.staged.nbytes)
                job.staged = None

    # -- rank 0's worker side (tensor parallel) ---------------------------------------------------------
    def start_load_kv(self, meta: PDMeta | None, kv_buffer) -> None:
        if self.heads is None:
            return
        jobs, self._placing = self._placing, []
        # Every rank writes its heads before this step's forward.
        self.heads.apply(meta, kv_buffer, [j.staged for j in jobs])
        if jobs:
            self.stats.tp_copy_seconds += time.perf_counter() - self._meta_at
        for job in jobs:
            self._unstage(job)
            with self._lock:
                self._first[job.rid] = job.first
                self._recv_done.add(job.rid)


def _why(reason) -> str:
    if reason is None:
        return "the decode request ended"
    return f"the decode request ended ({reason.type}{': ' + reason.message if reason.message else ''})"
