"""HiSparse's books (the scheduler side): a request that decodes sparsely keeps its whole KV in a host
pool and only a fixed budget of hot pages in the KV pool.

Who owns what, per sparse request (``SparseHold``)::

    host pages   ``req X [hisparse host]``  its KV history, page i of the sequence in ``host[i]``;
                                            reserved at admission for prompt + max new tokens (every
                                            decoded token is backed up too: SGLang's overflow bug)
    hot pages    ``req X [hisparse hot]``   KV-pool pages: ``hot[0]`` takes the page being written,
                                            ``hot[1:]`` hold the pages attention selected (per layer
                                            and KV head; the worker's LRU maps say which). Where the
                                            kernel reads the host pool in place (the CPU backend) only
                                            ``hot[0]`` is held: ``hot_pages`` is 1 there
    dense pages  (as any request's)         the prompt's KV until the first decode step has copied it
                                            to the host pages (``begin``); then cached or freed -- a
                                            session turn's stay its own (borrowed: the session's) to
                                            the end of the turn, when the prompt's pages become the
                                            session's as a dense turn's do (``KVManager.release``)

Session turns: a turn whose whole prompt (history + input) crosses ``--hisparse-min-context`` decodes
sparsely like any request (its attention reads the host copy made at its first decode step). Its
dense pages are not given back at that step: the session's own pages are borrowed and its new ones
are the turn's, and a completed turn hands the prompt's pages (``begun_len`` tokens) to its session;
the KV of the turn's output tokens lived in host pages only and is recomputed by the next turn, whose
prompt holds them. An aborted turn frees its own pages and leaves the session as it was. A turn whose
host room could never be had decodes densely (it is not refused: the history was accepted turn by
turn).

The pages are taken at admission, so the hot-buffer budget gates admission like any page. Everything
goes back on the one release path (``KVManager.release`` calls ``release``): finish (a PD
prebuilt finish and ``/health_generate`` included, seed 003), abort, retraction, an admission that
does not complete. The worker's per-slot state (LRU maps, page summaries) is dropped by an ``ends``
entry of the next step before any ``begins`` (a reused request slot starts clean).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import MemoryLedgerError
from .audit import AuditReport, Holding
from .pools import IdPool


@dataclass(slots=True)
class SparseBegin:
    """The worker copies ``kv_len`` tokens of KV from the KV-pool ``dense_pages`` into ``host_pages``
    (and the partial last page into ``hot[0]``) and starts the slot's sparse state."""

    slot: int
    dense_pages: list[int]
    host_pages: list[int]  # every reserved host page of the request (the first ones get the prompt)
    hot_pages: list[int]
    kv_len: int
    in_host_from: int | None = None  # pages from this one on are in host already (PD: sent there)


@dataclass
class SparseStep:
    """HiSparse's share of a step (``SchedulerOutput.hisparse``): applied before the forward, ends first."""

    ends: list[int] = field(default_factory=list)  # request slots whose sparse state goes
    begins: list[SparseBegin] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # slots whose decode this step attends sparsely

    def __bool__(self) -> bool:
        return bool(self.ends or self.begins or self.rows)


@dataclass
class SparseHold:
    host: list[int]
    hot: list[int]
    active: bool = False  # decoding sparsely: its KV is in ``host``, its dense pages given back
    begun_len: int = 0  # kv_len at ``begin`` (the dense pages' extent, given back after that step)
    host_from: int | None = None  # PD decode: KV from this page on was sent into ``host`` directly


class HostPagePool(IdPool):
    """The host pool's page ids (their K/V live on the worker side, ``model/hisparse.py``)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.num_ids = n

    def alloc_many(self, n: int, owner: str) -> list[int] | None:
        return self._take(n, owner)

    def free_many(self, ids: list[int], by: str) -> list[int]:
        """Returns the ids that were already free (double frees; the caller reports them)."""
        return self._give_back(ids, by)


class SparseKV:
    """Admission's reservation, the first sparse step, and the release of a sparse request's pages."""

    def __init__(self, kv_manager, cfg, num_host_pages: int, context_length: int, hot_pages: int | None = None):
        self.kvm = kv_manager
        self.cfg = cfg  # HiSparseSettings
        # KV-pool pages each sparse request holds (None: --hisparse-hot-pages; 1 where attention reads the
        # host pool in place and never uses hot[1:])
        self.hot_pages = cfg.hisparse_hot_pages if hot_pages is None else hot_pages
        self.page_size = kv_manager.page_size
        self.context_length = context_length
        self.host = HostPagePool(num_host_pages)
        self._ends: list[int] = []
        self._begins: list[SparseBegin] = []
        self.begun: list[tuple] = []  # (req, hold) begun in the step being scheduled
        # (req, hold) begun, by the step whose forward copies their KV: their dense pages go back once
        # that step's result is in (overlap: a later step may be scheduled and launched before that)
        self._begun_by_step: dict[int, list[tuple]] = {}
        self.total_begun = 0
        self.total_landed = 0  # PD decode: requests whose KV was sent into their host pages

    # -- which requests ----------------------------------------------------------------------------
    def eligible(self, req) -> bool:
        """Long enough and decodes; a session turn also needs host room the pool can ever give (else it
        decodes densely: its history was accepted turn by turn and is not refused now)."""
        return (
            len(req.input_ids) >= self.cfg.hisparse_min_context
            and not req.params.scoring
            and req.pooling is None
            and (req.session is None or self.host_pages_needed(req) <= self.host.num_ids)
        )

    def host_pages_needed(self, req) -> int:
        tokens = min(len(req.input_ids) + req.params.max_new_tokens, self.context_length)
        return -(-tokens // self.page_size)

    def too_big(self, req) -> str | None:
        """Why ``req`` can never get its host room (checked before anything is held), or None."""
        if req.session is not None or not self.eligible(req):
            return None
        need = self.host_pages_needed(req)
        if need > self.host.num_ids:
            ps = self.page_size
            return (
                f"the HiSparse host pool ({self.host.num_ids * ps} tokens) cannot hold this request's prompt "
                f"+ max new tokens ({need * ps} tokens in pages of {ps}); lower max_tokens or raise "
                "--hisparse-host-ratio"
            )
        return None

    # -- admission -----------------------------------------------------------------------------------
    def reserve(self, req) -> bool:
        """Host room for prompt + max new tokens and the hot pages, all or nothing. False: not now."""
        if req.sparse is not None or not self.eligible(req):
            return True
        rid = req.rid
        host = self.host.alloc_many(self.host_pages_needed(req), f"req {rid} [hisparse host]")
        if host is None:
            return False
        hot = self.kvm._alloc_pages(self.hot_pages, f"req {rid} [hisparse hot]")
        if hot is None:
            self.host.free_many(host, f"req {rid}")
            return False
        req.sparse = SparseHold(host, hot)
        return True

    # -- KV that a PD prefill server sends ---------------------------------------------------------------
    def land(self, req) -> list[int]:
        """``req``'s KV past what the KV pool holds (its prefix match) arrives straight into its host
        pages (``req X [hisparse staging]`` until it is in): the pages the connector writes, indexed
        by sequence page like ``req.pages``."""
        req.sparse.host_from = len(req.pages)
        self.total_landed += 1
        return req.sparse.host

    def ready(self, req) -> bool:
        """Whether ``req``'s next step may be its first sparse one: it has its first output token (the
        prompt's attention was dense to its end), or its KV is in host pages already (PD)."""
        h = req.sparse
        return h is not None and not h.active and (req.kv_len >= len(req.input_ids) or h.host_from is not None)

    # -- the first sparse step --------------------------------------------------------------------------
    def begin(self, req) -> None:
        """``req``'s next step is its first decode: the worker copies its KV to the host pages before
        the forward, the step writes its new token into ``hot[0]``, and after the step its dense pages
        are given back (``drop_begun``)."""
        h = req.sparse
        ps = self.page_size
        n = -(-req.kv_len // ps)
        self._begins.append(
            SparseBegin(req.slot, list(req.pages[:n]), list(h.host), list(h.hot), req.kv_len, h.host_from)
        )
        h.active, h.begun_len = True, req.kv_len
        self.begun.append((req, h))
        self.total_begun += 1

    def write_page(self, req, num_tokens: int) -> None:
        """Map the positions the next ``num_tokens`` go to (a page boundary: the next page) onto
        ``hot[0]`` (the page table's entry is what the step's ``out_loc`` reads)."""
        ps, h = self.page_size, req.sparse
        if req.kv_len + num_tokens > len(h.host) * ps:
            raise MemoryLedgerError(f"req {req.rid} writes past its reserved host pages")
        first, last = req.kv_len // ps, (req.kv_len + num_tokens - 1) // ps
        for p in range(first, last + 1):
            if p == first and req.kv_len % ps and req.kv_len != h.begun_len:
                continue  # mid-page: already mapped
            self.kvm._map(req, p, [h.hot[0]])

    def drop_begun(self, step: int) -> None:
        """After step ``step``'s result: the requests it began have their prompt KV in host pages now;
        their dense pages go back (cached for later requests' prefix matches, as any finished prompt).
        Under overlap the next step was scheduled already: what it began waits for its own result."""
        for req, h in self._begun_by_step.pop(step, ()):
            # (A request retracted after its begin and admitted again in the same step has a new hold.
            # A session turn keeps its dense pages for its session: ``KVManager.release``.)
            if req.sparse is h and req.to_finish is None and req.slot is not None and req.session is None:
                # (What the KV pool held: all of it, or only decode's own prefix match under PD.)
                self.kvm.give_back_dense(req, min(h.begun_len, len(req.pages) * self.page_size))

    # -- the one release path -----------------------------------------------------------------------------
    def release(self, req) -> None:
        """Everything ``req``'s sparse hold owns goes back; the worker drops the slot's state next step."""
        h = req.sparse
        if h is None:
            return
        owner = f"req {req.rid}"
        doubles = self.host.free_many(h.host, owner)
        if doubles:
            self.kvm.report_double_free(doubles, owner, tier="HiSparse host")
        self.kvm.free(h.hot, owner)
        if h.active and req.slot is not None:
            self._ends.append(req.slot)
            self._begins = [b for b in self._begins if b.slot != req.slot]
        req.sparse = None

    @property
    def has_pending(self) -> bool:
        """Ops the worker has not had yet (the slots' state of requests that ended)."""
        return bool(self._ends or self._begins)

    def take_step(self, rows: list[int], step_id: int) -> SparseStep | None:
        """The worker's ops for step ``step_id`` (its begins' dense pages go at ``drop_begun(step_id)``)."""
        if self.begun:
            self._begun_by_step[step_id] = self.begun
            self.begun = []
        step = SparseStep(self._ends, self._begins, rows)
        self._ends, self._begins = [], []
        return step if step else None

    # -- books --------------------------------------------------------------------------------------------
    @staticmethod
    def holdings(req) -> Iterable[Holding]:
        h = req.sparse
        if h is not None:
            yield Holding(owner=f"req {req.rid} [hisparse hot]", kind="hisparse_hot", own_pages=h.hot)
            # (The request's state by its ledger label: memory/ does not import the scheduler.)
            staging = h.host_from is not None and req.state.ledger_label == "waiting for kv"
            state = "staging" if staging else "host"
            yield Holding(owner=f"req {req.rid} [hisparse {state}]", kind="hisparse_host", own_pages=(),
                          sparse_host_pages=h.host)  # fmt: skip


class SparseBooks:
    """The host pool's books for the ledger: conservation, the audit, production reclaim, figures."""

    def __init__(self, sparse: SparseKV):
        self.sparse = sparse

    def _held(self, holdings: list[Holding]) -> int:
        return sum(len(h.sparse_host_pages) for h in holdings)

    def conservation_problems(self, holdings: list[Holding]) -> list[str]:
        pool = self.sparse.host
        held = self._held(holdings)
        if pool.num_free + held != pool.num_ids:
            return [f"HiSparse host conservation broken: free {pool.num_free} + held {held} != total {pool.num_ids}"]
        return []

    def audit(self, report: AuditReport, holdings: list[Holding]) -> None:
        pool = self.sparse.host
        owners: dict[int, list[str]] = {}
        for p in pool.free_list():
            owners.setdefault(p, []).append("free")
        for h in holdings:
            for p in h.sparse_host_pages:
                owners.setdefault(p, []).append(h.owner)
        for i in range(pool.num_ids):
            o = owners.get(i)
            if not o:
                report.leaked_sparse_host_pages[i] = pool.last_owner[i]
            elif len(o) > 1:
                report.double_sparse_host_pages[i] = o

    def reclaim(self, report: AuditReport) -> None:
        if report.leaked_sparse_host_pages:
            self.sparse.host.free_many(list(report.leaked_sparse_host_pages), "ledger reclaim")

    def figures(self, holdings: list[Holding]) -> dict:
        pool, ps = self.sparse.host, self.sparse.page_size
        cfg = self.sparse.cfg
        return {
            "host_total": pool.num_ids * ps,
            "host_free": pool.num_free * ps,
            "host_held": self._held(holdings) * ps,
            "hot_held": sum(len(h.own_pages) for h in holdings if h.kind == "hisparse_hot") * ps,
            "requests_begun": self.sparse.total_begun,
            "requests_landed_in_host": self.sparse.total_landed,
            "top_k_pages": cfg.hisparse_top_k_pages,
            "hot_pages": self.sparse.hot_pages,
            "min_context": cfg.hisparse_min_context,
        }
