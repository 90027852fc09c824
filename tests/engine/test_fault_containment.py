"""A fault while computing one request ends that request with a 500 through the release path; its
batch neighbours produce exactly what they would have."""

from __future__ import annotations

import time

from kvledger import Engine
from tests.helpers import assert_idle_clean

G = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 16}


def test_injected_fault_is_contained(tiny_loaded, monkeypatch):
    prompts = [[3 + i] * (10 + 9 * i) for i in range(5)]
    ref = Engine(loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, strict_memory=True)
    refs = [ref.generate(input_ids=p, sampling_params=G)["output_ids"] for p in prompts]
    monkeypatch.setenv("KVLEDGER_TEST_FAULT_RIDS", "bad")
    eng = Engine(
        loaded_model=tiny_loaded, dtype="float32", max_total_tokens=2048, strict_memory=True, page_size=16
    )
    rids = [eng.add_request(p, G, rid="bad" if i == 2 else None) for i, p in enumerate(prompts)]
    eng.run_until_idle()
    for i, rid in enumerate(rids):
        res = eng.result(rid)
        if rid == "bad":
            fr = res["meta_info"]["finish_reason"]
            assert fr["type"] == "abort" and "injected fault" in fr["message"]
            assert res["output_ids"] == []
        else:
            assert res["output_ids"] == refs[i]
    assert_idle_clean(eng)
    assert_idle_clean(ref)


def test_shutdown_is_bounded_when_work_cannot_end(make_engine, monkeypatch, caplog):
    """An engine whose work can never end (here a connector that always has I/O in flight: a PD
    transfer whose peer is gone, or books a failed step left inconsistent) still shuts down: the drain
    gives up after its timeout with an error naming what was left, and the executor and connector are
    closed. It stepped forever before (the combination fuzz hung in teardown after a violation)."""
    eng = make_engine()
    eng.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2})
    conn = eng.core.scheduler.connector
    monkeypatch.setattr(type(conn), "has_pending", property(lambda self: True))
    closed = []
    monkeypatch.setattr(eng.core.executor, "shutdown", lambda: closed.append("executor"))
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="kvledger.engine.core"):
        eng.shutdown(drain_timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    assert closed == ["executor"]
    assert any("work left after" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert eng.core.kv_manager.ledger.audit(count=False).ok  # nothing was held: the books still hold
