"""Property tests over the pools, the radix cache and the ledger, driven through the same
``KVManager`` calls the scheduler makes (admit / allocate with lookahead / truncate / release) plus direct tree operations."""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger.common import SamplingParams
from kvledger.errors import MemoryLedgerError
from kvledger.memory import Holding, KVManager, PagePool, request_holding
from kvledger.scheduler import Req

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=40)  # tiny alphabet: many shared prefixes


class LedgerMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 4]), num_pages=st.integers(8, 48))
    def setup(self, page_size, num_pages):
        self.reqs: list[Req] = []
        self.readers: list[tuple[object, list[int]]] = []  # (locked node, its pages) held by a reader
        self.kv = KVManager(
            num_pages,
            page_size,
            num_slots=6,
            enable_prefix_cache=True,
            strict=True,
            holdings=self.holdings,
        )
        self.n = 0

    def holdings(self):
        for r in self.reqs:
            yield request_holding(r)
        for i, (_, pages) in enumerate(self.readers):
            yield Holding(owner=f"reader {i}", kind="request", own_pages=(), borrowed_pages=pages)

    @rule(tokens=TOKENS)
    def admit(self, tokens):
        self.n += 1
        req = Req(rid=f"r{self.n}", input_ids=tokens, params=SamplingParams())
        if self.kv.admit(req):
            self.reqs.append(req)
            assert req.kv_len <= len(tokens) - 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 20))
    def compute(self, data, n):
        req = data.draw(st.sampled_from(self.reqs))
        n = min(n, req.seq_len - req.kv_len)
        if n > 0 and self.kv.allocate(req, n):
            req.kv_len += n  # as if a forward computed them
            assert len(req.pages) * self.kv.page_size >= req.kv_len

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 4), lookahead=st.integers(1, 9), accepted=st.integers(0, 9))
    def speculate(self, data, n, lookahead, accepted):
        """A verify step: pages for n tokens plus drafts, then the rejected drafts given back."""
        req = data.draw(st.sampled_from(self.reqs))
        n = min(n, req.seq_len - req.kv_len)
        if n <= 0 or not self.kv.allocate(req, n, num_lookahead_tokens=lookahead):
            return
        assert len(req.pages) * self.kv.page_size >= req.kv_len + n + lookahead
        req.kv_len += n + lookahead  # the forward wrote KV for the drafts too
        acc = min(accepted, lookahead)
        req.output_ids.extend([0] * (acc + 1))  # accepted drafts and the bonus token join the sequence
        keep = req.kv_len - lookahead + acc
        self.kv.truncate(req, keep)
        assert req.kv_len == keep
        assert len(req.pages) == max(-(-keep // self.kv.page_size), req.num_tree_pages)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=5))
    def decode_more(self, data, extra):
        req = data.draw(st.sampled_from(self.reqs))
        req.output_ids.extend(extra)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), commit=st.booleans())
    def release(self, data, commit):
        req = data.draw(st.sampled_from(self.reqs))
        self.reqs.remove(req)
        self.kv.release(req, commit=commit)
        assert req.slot is None and not req.pages

    @rule(tokens=TOKENS)
    def match_and_lock(self, tokens):
        pages, node = self.kv.tree.match_prefix(tokens)
        self.kv.tree.inc_lock(node)
        self.readers.append((node, pages))

    @precondition(lambda self: self.readers)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.readers) - 1))
        node, _ = self.readers.pop(i)
        self.kv.tree.dec_lock(node)

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        before = self.kv.pages.num_free
        freed = self.kv.tree.evict(n)
        assert self.kv.pages.num_free == before + freed

    @rule(tokens=TOKENS)
    def match_is_consistent(self, tokens):
        pages, _node = self.kv.tree.match_prefix(tokens)
        assert len(pages) * self.kv.page_size <= len(tokens)
        assert not any(self.kv.pages.is_free(p) for p in pages)

    @invariant()
    def books_balance(self):
        if not hasattr(self, "kv"):
            return
        self.kv.ledger.check_conservation()
        report = self.kv.ledger.audit()
        assert report.ok, report.describe()
        # The page map (/memory/pages) covers the pool once, in runs, and agrees with the figures.
        runs = self.kv.ledger.page_runs()
        assert [r["start"] for r in runs] == list(itertools.accumulate([0] + [r["count"] for r in runs[:-1]]))
        assert sum(r["count"] for r in runs) == self.kv.pages.num_pages
        per_kind = collections.Counter()
        for r in runs:
            per_kind[r["kind"]] += r["count"]
        figures = self.kv.ledger.figures()
        for kind in ("free", "cached_evictable", "cached_protected", "private", "session"):
            assert per_kind[kind] * self.kv.page_size == figures[f"kv_{kind}"], kind
        owners = {r["owner"] for r in runs if r["kind"] == "private"}
        assert owners <= {f"req {r.rid}" for r in self.reqs}

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for req in self.reqs:
            self.kv.release(req, commit=True)
        for node, _ in self.readers:
            self.kv.tree.dec_lock(node)
        self.kv.tree.flush()
        assert self.kv.pages.num_free == self.kv.pages.num_pages
        assert self.kv.slots.num_free == self.kv.slots.num_slots


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class DroppingPool(PagePool):
    """A test double that loses one page on purpose (the bug class of the seed reports)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.dropped: int | None = None

    def free(self, pages, by):
        if self.dropped is None and pages:
            self.dropped = pages[0]
            pages = pages[1:]
        return super().free(pages, by)


def _manager(strict: bool) -> tuple[KVManager, list[Req]]:
    reqs: list[Req] = []
    kv = KVManager(
        16,
        4,
        num_slots=4,
        enable_prefix_cache=True,
        strict=strict,
        holdings=lambda: (request_holding(r) for r in reqs),
    )
    kv.pages = DroppingPool(16, 4)
    kv.ledger.pages = kv.pages
    return kv, reqs


def test_a_dropped_page_is_caught_and_named():
    kv, _reqs = _manager(strict=True)
    req = Req(rid="victim", input_ids=list(range(10)), params=SamplingParams())
    assert kv.admit(req) and kv.allocate(req, 10)
    req.kv_len = 10
    kv.release(req, commit=False)
    dropped = kv.pages.dropped
    assert dropped is not None
    with pytest.raises(MemoryLedgerError) as e:
        kv.ledger.check_conservation()
    assert f"{dropped} (req victim)" in str(e.value)
    report = kv.ledger.audit(count=False)
    assert report.leaked_pages == {dropped: "req victim"}


def test_production_mode_quarantines_then_reclaims_and_counts():
    """Production mode: a page nobody's books hold is quarantined (counted, shown, not free), and freed
    by a later audit once proven unowned (no request live when it was found is left)."""
    kv, _reqs = _manager(strict=False)
    req = Req(rid="victim", input_ids=list(range(10)), params=SamplingParams())
    assert kv.admit(req) and kv.allocate(req, 10)
    kv.release(req, commit=False)
    dropped = kv.pages.dropped
    kv.ledger.audit()  # logs, counts, quarantines; does not raise
    assert kv.ledger.violations == 1 and kv.ledger.quarantined_pages == 1 and kv.ledger.reclaimed_pages == 0
    assert kv.pages.num_free == kv.pages.num_pages - 1 and not kv.pages.is_free(dropped)
    m = kv.ledger.figures()
    assert m["kv_quarantined"] == kv.page_size and m["leak_check"]["quarantined_pages_total"] == 1
    kv.ledger.check_conservation()  # free + ... + quarantined == total
    runs = [r for r in kv.ledger.page_runs() if r["kind"] == "quarantined"]
    assert runs == [{"start": dropped, "count": 1, "kind": "quarantined", "owner": "quarantine (last owner: req victim)"}]
    assert kv.ledger.audit().ok  # not a new leak; nothing live: proven unowned, freed
    assert kv.ledger.reclaimed_pages == 1 and kv.pages.num_free == kv.pages.num_pages
    assert kv.ledger.figures()["kv_quarantined"] == 0 and kv.ledger.violations == 1


def test_double_owned_page_is_reported():
    kv, reqs = _manager(strict=True)
    a = Req(rid="a", input_ids=list(range(8)), params=SamplingParams())
    b = Req(rid="b", input_ids=list(range(8)), params=SamplingParams())
    assert kv.admit(a) and kv.allocate(a, 8) and kv.admit(b)
    b.pages.append(a.pages[-1])  # a corruption: b claims a's page
    reqs.extend([a, b])
    report = kv.ledger.audit(count=False)
    assert a.pages[-1] in report.double_pages
    assert set(report.double_pages[a.pages[-1]]) == {"private to req a", "private to req b"}


def test_page_map_names_a_leaked_page_by_its_last_owner():
    kv, _reqs = _manager(strict=True)
    req = Req(rid="victim", input_ids=list(range(10)), params=SamplingParams())
    assert kv.admit(req) and kv.allocate(req, 10)
    kv.release(req, commit=False)
    leaked = [r for r in kv.ledger.page_runs() if r["kind"] == "unowned"]
    assert leaked == [{"start": kv.pages.dropped, "count": 1, "kind": "unowned", "owner": "req victim"}]
