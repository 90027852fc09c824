"""The KV connector seam: KV arriving from elsewhere (the request holds its slot and pages in the
ledger state "waiting for kv" until the load is reported done) and KV that must stay until an async
save ends ("kv sending"). Driven through the real engine step and in-process executor with a fake
model; strict memory checks conservation every step."""

from __future__ import annotations

from kvledger.connector import KVConnector
from tests.fakes import chain, use_fake_model
from tests.helpers import assert_idle_clean


class FakeConnector(KVConnector):
    """Requests whose rid starts with "remote" get all but their last prompt token from "elsewhere",
    arriving ``delay`` steps later; requests whose rid starts with "send" are saved asynchronously,
    done ``delay`` steps after they finish."""

    def __init__(self, delay: int = 3):
        self.delay = delay
        self.loads: dict[str, int] = {}  # rid -> steps left
        self.saves: dict[str, int] = {}
        self.allocated: dict[str, tuple[list[int], int]] = {}
        self.finished_calls: list[str] = []
        self.worker_calls = 0

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        if not req.rid.startswith("remote"):
            return 0, False
        return req.seq_len - 1 - num_computed_tokens, True

    def update_state_after_alloc(self, req, pages, num_external_tokens):
        self.allocated[req.rid] = (list(pages), num_external_tokens)
        self.loads[req.rid] = self.delay

    def request_finished(self, req):
        self.finished_calls.append(req.rid)
        self.loads.pop(req.rid, None)  # an abort cancels the load
        if req.rid.startswith("send"):
            self.saves[req.rid] = self.delay
            return True
        return False

    def start_load_kv(self, meta, kv_buffer):
        self.worker_calls += 1

    def get_finished(self):
        done_send, done_recv = set(), set()
        for table, done in ((self.loads, done_recv), (self.saves, done_send)):
            for rid in list(table):
                table[rid] -= 1
                if table[rid] <= 0:
                    del table[rid]
                    done.add(rid)
        return done_send, done_recv


def _engine(make_engine, **kw):
    conn = FakeConnector()
    eng = make_engine(kv_connector=conn, page_size=4, **kw)
    use_fake_model(eng.core)
    return eng, conn


def _owners(eng) -> dict[str, int]:
    return {h.owner: len(h.own_pages) for h in eng.core.scheduler.holdings() if h.kind == "request"}


def test_kv_arrives_then_the_request_decodes(make_engine):
    eng, conn = _engine(make_engine)
    prompt = list(range(10, 30))
    rid = eng.add_request(prompt, {"max_new_tokens": 6, "ignore_eos": True}, rid="remote-1")
    eng.step()
    pages, n = conn.allocated["remote-1"]
    assert n == len(prompt) - 1 and len(pages) == -(-n // 4)
    assert _owners(eng) == {"req remote-1 [waiting for kv]": len(pages)}
    assert eng.memory()["kv_private"] == len(pages) * 4
    eng.step()
    assert _owners(eng) == {"req remote-1 [waiting for kv]": len(pages)}  # still arriving
    while eng.result(rid, pop=False) is None:
        eng.step()
    res = eng.result(rid)
    assert res["output_ids"] == chain(prompt[-1], 6)
    assert res["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert conn.worker_calls > 0 and conn.finished_calls == ["remote-1"]
    assert_idle_clean(eng)


def test_abort_while_kv_arrives_frees_everything(make_engine):
    eng, conn = _engine(make_engine)
    rid = eng.add_request(list(range(3, 40)), {"max_new_tokens": 6}, rid="remote-2")
    eng.step()
    assert "req remote-2 [waiting for kv]" in _owners(eng)
    eng.abort(rid)
    eng.step()
    assert eng.result(rid)["meta_info"]["finish_reason"]["type"] == "abort"
    assert "remote-2" not in conn.loads  # the connector was told, and cancelled its load
    assert _owners(eng) == {}
    assert_idle_clean(eng)


def test_pages_stay_until_the_async_save_ends(make_engine):
    eng, conn = _engine(make_engine)
    assert conn.saves == {}
    rid = eng.add_request(list(range(50, 61)), {"max_new_tokens": 4, "ignore_eos": True}, rid="send-1")
    while eng.result(rid, pop=False) is None:
        eng.step()
    assert eng.result(rid)["output_ids"] == chain(60, 4)  # the client has its answer ...
    owners = _owners(eng)
    assert list(owners) == ["req send-1 [kv sending]"] and owners["req send-1 [kv sending]"] > 0
    assert eng.memory()["req_slots_free"] == eng.memory()["req_slots_total"] - 1  # ... the KV stays
    assert not eng.core.scheduler.idle
    assert "send-1" in conn.saves
    eng.run_until_idle()  # the save ends: released through the same release path
    assert _owners(eng) == {} and conn.finished_calls == ["send-1"]
    assert_idle_clean(eng)


def test_a_mix_of_local_remote_and_saved_requests(make_engine):
    eng, _conn = _engine(make_engine, max_total_tokens=256, chunked_prefill_size=16)
    rids = ["remote-a", "local-b", "send-c", "remote-d", "local-e"]
    prompts = [[5 + i] * (9 + 5 * i) for i in range(len(rids))]
    for rid, p in zip(rids, prompts):
        eng.add_request(p, {"max_new_tokens": 12, "ignore_eos": True}, rid=rid)
    while not eng.core.scheduler.idle:
        eng.step()
        eng.core.kv_manager.ledger.check_conservation()
    for rid, p in zip(rids, prompts):
        assert eng.result(rid)["output_ids"] == chain(p[-1], 12), rid
    assert_idle_clean(eng)
