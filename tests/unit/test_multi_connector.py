"""``MultiConnector``: a request's external KV from the connectors in order (each from where the
ones before stopped; an async one takes the rest), ``cached_tokens`` per part, and held pages
released only once every holder reported."""

from __future__ import annotations

from types import SimpleNamespace

from kvledger.connector import KVConnector, MultiConnector


class Stub(KVConnector):
    def __init__(self, name: str, n, cached: bool = True, hold: bool = False, load_async: bool = False):
        self.name, self.n, self.hold, self.load_async = name, n, hold, load_async
        self.external_tokens_are_cached = cached
        self.asked: list[tuple[str, int]] = []
        self.allocated: list[tuple[str, list[int], int]] = []
        self.done: set[str] = set()
        self.metas: list = []

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        self.asked.append((req.rid, num_computed_tokens))
        n = self.n(req, num_computed_tokens) if callable(self.n) else self.n
        return n, self.load_async and bool(n)

    def update_state_after_alloc(self, req, pages, num_external_tokens):
        self.allocated.append((req.rid, list(pages), num_external_tokens))

    def request_finished(self, req):
        return self.hold and req.rid == "r"

    def build_connector_meta(self, sched_out):
        return self.name

    def start_load_kv(self, meta, kv_buffer):
        self.metas.append(meta)

    def get_finished(self):
        done, self.done = self.done, set()
        return done, set()


def req(rid: str):
    return SimpleNamespace(rid=rid)


PROMPT = 40  # tokens; pages of 4


def test_tiers_then_transfer_each_from_where_the_last_stopped():
    tiers = Stub("tiers", lambda r, at: 16 if r.rid != "miss" else 0)
    transfer = Stub("transfer", lambda r, at: PROMPT - at if r.rid != "direct" else 0, cached=False,
                    load_async=True)  # fmt: skip
    m = MultiConnector([tiers, transfer], page_size=4)
    # 8 tokens of L1 prefix; the tiers hold 16 more; the transfer brings the other 16 (and token 1).
    assert m.get_num_new_matched_tokens(req("pd"), 8) == (32, True)
    assert transfer.asked[-1] == ("pd", 24)
    m.update_state_after_alloc(req("pd"), list(range(100, 108)), 32)
    assert tiers.allocated[-1] == ("pd", list(range(100, 108)), 16)
    assert transfer.allocated[-1] == ("pd", list(range(104, 108)), 16)  # after the tiers' 4 pages
    assert m.cached_external_tokens(req("pd"), 32) == 16  # the tier's hit is cached, the transfer not
    # A tier miss: all from the transfer. No room (the transfer answers 0): the tiers' part alone.
    assert m.get_num_new_matched_tokens(req("miss"), 8) == (32, True)
    assert m.cached_external_tokens(req("miss"), 32) == 0
    assert m.get_num_new_matched_tokens(req("direct"), 8) == (16, False)
    assert m.cached_external_tokens(req("direct"), 16) == 16
    # A connector not ready yet (None) defers the request before the later ones are asked.
    n = len(transfer.asked)
    assert MultiConnector([Stub("t", None), transfer], 4).get_num_new_matched_tokens(req("pd"), 0) == (None, False)
    assert len(transfer.asked) == n


def test_an_async_load_ends_the_chain():
    first = Stub("first", lambda r, at: PROMPT - at, load_async=True)
    later = Stub("later", 8)
    assert MultiConnector([first, later], 4).get_num_new_matched_tokens(req("x"), 0) == (PROMPT, True)
    assert later.asked == []


def test_metadata_goes_to_each_connector_in_order():
    a, b = Stub("a", 0), Stub("b", 0)
    m = MultiConnector([a, b], 4)
    m.start_load_kv(m.build_connector_meta(None), None)
    m.start_load_kv(None, None)  # a step without metadata: None to each
    assert a.metas == ["a", None] and b.metas == ["b", None]


def test_held_pages_are_reported_once_every_holder_is_done():
    a, b, c = Stub("a", 0, hold=True), Stub("b", 0, hold=True), Stub("c", 0)
    m = MultiConnector([a, b, c], 4)
    assert m.request_finished(req("r")) is True
    assert m.request_finished(req("free")) is False
    a.done = {"r"}
    assert m.get_finished() == (set(), set())  # b still holds its pages
    b.done = {"r"}
    assert m.get_finished() == ({"r"}, set())
    c.done = {"other"}  # not held through the composite: passed on as it came
    assert m.get_finished() == ({"other"}, set())
